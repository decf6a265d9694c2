# Types of the compiled frame decoder (_wirec.c).
from collections.abc import Callable, Sequence
from typing import Any

def decode_many(buffer: memoryview, sizes: list[int], max_frame_bytes: int, /) -> Any: ...
def configure(
    specs: Sequence[tuple[int, int, Any, bool, bool]],
    frombuffer: Callable[..., Any],
    make_tensor: Callable[..., Any],
    /,
) -> None: ...
