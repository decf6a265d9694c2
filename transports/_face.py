"""The machinery behind a public face: one declaration per public name, served lazily.

A public module (``evenflow.transports``, ``evenflow.engine``, ``evenflow.engine.planning``)
declares each of its names once, as a re-export in the form type checkers already read as
"public" (PEP 484's redundant alias): ``from evenflow.engine._config import LoaderConfig as
LoaderConfig``. Names the module must import at once are written at top level; names served
lazily are written under ``if TYPE_CHECKING:``, so type checkers see the real objects while a
run imports their modules only on first access. :func:`serve` reads those statements back from
the module's source and derives everything else from them: ``__all__``, ``__getattr__`` and
``__dir__``. There is no second list to forget to update. It lives here, in the lower of the
two packages, because the engine may import the transports and never the reverse.

A served class or function reports its public home in ``__module__`` (as httpx does), so reprs,
pickles and generated documentation name ``evenflow.engine.BalancedLoader`` rather than the
private module that defines it. Two things read ``__module__`` to find the *defining* module,
and the stamp keeps one of them working:

* ``typing.get_type_hints(cls)`` evaluates a class's string annotations in the globals of
  ``sys.modules[cls.__module__]``; the public face lacks the names they use (``Mapping``,
  ``np``...). A class's own annotations are therefore evaluated in the defining module before
  the stamp, and stored evaluated, so ``get_type_hints`` answers exactly as before.
* ``inspect.getsource(cls)`` looks for the class in the public module's file and no longer
  finds it (functions are found through their code object and are unaffected). httpx accepts
  the same limit; tracebacks show the defining file and line as before.

The stamp is applied when the face serves a name: the face's eager names at import, a lazy name
on its first access, and with it every other lazy name whose defining module is loaded by then
(the classes a loader's import brings in, whose objects the engine creates without the caller
naming them). A class whose module is imported only later, and that no face access has
followed, still reports its defining module until the next access.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
import typing
from typing import Any

__all__ = ["declared_names", "serve"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _reexports(statements: list[ast.stmt]) -> dict[str, str]:
    """``{name: module}`` for every ``from module import name as name`` among ``statements``."""
    found: dict[str, str] = {}
    for stmt in statements:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
            for alias in stmt.names:
                if alias.asname == alias.name:
                    found[alias.name] = stmt.module
    return found


def declared_names(source: str) -> tuple[dict[str, str], dict[str, str]]:
    """The public names a face's ``source`` declares: ``(eager, lazy)``, each ``{name: module}``.

    Eager names are top-level re-exports; lazy names are the re-exports under a top-level
    ``if TYPE_CHECKING:``. Plain imports (without the redundant alias) are the module's own
    business and are not exported.
    """
    tree = ast.parse(source)
    eager = _reexports(tree.body)
    lazy: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            lazy.update(_reexports(node.body))
    both = sorted(set(eager) & set(lazy))
    if both:
        raise ImportError(f"A public face declares {both} both eagerly and lazily; keep one.")
    return eager, lazy


def _freeze_annotations(cls: type) -> None:
    """Store ``cls``'s own annotations evaluated, while ``cls.__module__`` still names the
    module whose globals they were written against."""
    own = inspect.get_annotations(cls)
    if not own or not any(isinstance(value, str) for value in own.values()):
        return
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # unresolvable before the stamp too: leave it as it was
        return
    cls.__annotations__ = {name: hints.get(name, value) for name, value in own.items()}


def stamp(value: object, public: str | None, package: str) -> None:
    """Report ``public`` as the home of ``value`` if it is a class or function that one of
    ``package``'s private modules defines (re-exported foreign objects are left alone)."""
    if public is None or not isinstance(value, (type, types.FunctionType)):
        return
    home = getattr(value, "__module__", "")
    if not home.startswith(f"{package}._"):
        return
    if isinstance(value, type):
        _freeze_annotations(value)
    value.__module__ = public


def _missing(name: str, attr: str, moved_to: tuple[str, ...]) -> str:
    if not attr.startswith("__"):
        for other in moved_to:
            if attr in getattr(importlib.import_module(other), "__all__", ()):
                return f"{name}.{attr} lives in {other}; import it from there."
    return f"module {name!r} has no attribute {attr!r}"


def serve(name: str, *, moved_to: tuple[str, ...] = (), public_module: bool = True) -> None:
    """Make the module ``name`` a face: call it last, as ``serve(__name__)``.

    Sets the module's ``__all__`` (its declared names, sorted), ``__getattr__`` (imports a
    lazy name's module on first access and caches the object in the module) and ``__dir__``.
    A name this face does not serve but one of the faces in ``moved_to`` does is refused with
    an error that names its home (names moved between faces are not aliased).
    ``public_module=False`` (the engine's internal face of the transports) leaves the served
    objects' ``__module__`` as it is.
    """
    module = sys.modules[name]
    spec = module.__spec__
    loader = spec.loader if spec is not None else None
    get_source = getattr(loader, "get_source", None)
    source = get_source(name) if get_source is not None else None
    if source is None:
        raise ImportError(
            f"{name} declares its public names in its source, which its loader does not "
            f"provide; install evenflow from its source files rather than bytecode alone."
        )
    eager, lazy = declared_names(source)
    package = ".".join(name.split(".")[:2])
    namespace = vars(module)
    home_of = name if public_module else None
    for attr in eager:
        stamp(namespace[attr], home_of, package)
    unstamped = dict(lazy)  # lazy names whose objects have not been stamped yet

    def stamp_loaded() -> None:
        """Stamp the lazy names whose defining modules are loaded by now (imported as a side
        effect of another name): the engine creates objects of classes a caller never named
        (a StepStats from a loader), and these too should report their public home."""
        for attr, home in list(unstamped.items()):
            defining = sys.modules.get(home)
            if defining is not None and hasattr(defining, attr):
                stamp(getattr(defining, attr), home_of, package)
                del unstamped[attr]

    def __getattr__(attr: str) -> Any:
        home = lazy.get(attr)
        if home is None:
            raise AttributeError(_missing(name, attr, moved_to))
        value = getattr(importlib.import_module(home), attr)
        stamp(value, home_of, package)
        unstamped.pop(attr, None)
        if home_of is not None:
            stamp_loaded()
        namespace[attr] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(lazy))

    namespace["__all__"] = sorted([*eager, *lazy])
    namespace["__getattr__"] = __getattr__
    namespace["__dir__"] = __dir__
