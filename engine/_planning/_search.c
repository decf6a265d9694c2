/*
 * The first search phase: the upkeep of its state (samples' bins, sorted views, budget sums),
 * how a change is applied, and its table of move families with one attempt walking it (the
 * driver loop is _drive.h's; each family is in a file of its own).
 */
#include "_drive.h"
#include "_search.h"

/* _rank_samples: rank r's samples in bin order. */
Py_ssize_t rank_samples(const search_t *s, int64_t r, int64_t *out) {
    Py_ssize_t m = 0;
    for (Py_ssize_t b = r * s->per; b < (r + 1) * s->per; b++) {
        if (s->members[b].n) {
            memcpy(out + m, s->members[b].v, sizeof(int64_t) * (size_t)s->members[b].n);
        }
        m += s->members[b].n;
    }
    return m;
}

/*
 * Sum of budget column k over a bin's members, rounded as numpy's
 * ``bud[members].sum(axis=0)`` rounds it: with one budget the column is contiguous and numpy
 * sums it pairwise (blocks of eight partial sums, halves above 128 values); with several it
 * adds row after row.
 */
static double pairwise_column(const search_t *s, const int64_t *ids, Py_ssize_t n,
                              Py_ssize_t k) {
    const double *bud = s->bud;
    Py_ssize_t K = s->nbud;
    if (n < 8) {
        double res = -0.0;
        for (Py_ssize_t i = 0; i < n; i++) res += bud[ids[i] * K + k];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = bud[ids[j] * K + k];
        Py_ssize_t i = 8;
        for (; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; j++) r[j] += bud[ids[i + j] * K + k];
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += bud[ids[i] * K + k];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_column(s, ids, half, k) + pairwise_column(s, ids + half, n - half, k);
}

/* Bin b's budget sums afresh from its members (what the oracle's _refresh_budgets does). */
static void refresh_budgets(search_t *s, int64_t b) {
    Py_ssize_t K = s->nbud;
    if (K == 0) return;
    const vec_t *members = &s->members[b];
    double *out = s->bin_bud + b * K;
    if (K == 1) {
        out[0] = 0.0 + pairwise_column(s, members->v, members->n, 0);
        return;
    }
    for (Py_ssize_t k = 0; k < K; k++) out[k] = 0.0;
    for (Py_ssize_t j = 0; j < members->n; j++) {
        const double *row = s->bud + members->v[j] * K;
        for (Py_ssize_t k = 0; k < K; k++) out[k] += row[k];
    }
}

/* (cost, index) ascending: _sorted_samples, and the order of the rank views. */
static int cost_up(const search_t *s, int64_t i, int64_t j) {
    double ci = s->cost[i], cj = s->cost[j];
    return ci < cj || (ci == cj && i < j);
}

/* (tokens, index) ascending: the order of the bin views. */
static int tokens_up(const search_t *s, int64_t i, int64_t j) {
    int64_t ti = s->tok[i], tj = s->tok[j];
    return ti < tj || (ti == tj && i < j);
}

/* The first entry of a view (ordered by `before`, a strict total order) not before i. */
static Py_ssize_t view_position(const search_t *s, const vec_t *view, int64_t i,
                                before_t before) {
    Py_ssize_t lo = 0, hi = view->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (before(s, view->v[mid], i)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A sample leaves (gone = 1) or joins a fresh view, which stays sorted: O(size) instead of a
   re-sort. A view that cannot grow is marked stale (re-sorted, or failing, when next used). */
static void view_update(search_t *s, vec_t *view, unsigned char *stale, int64_t i, int gone,
                        before_t before) {
    if (*stale) return;
    Py_ssize_t k = view_position(s, view, i, before);
    if (gone) {
        memmove(view->v + k, view->v + k + 1, sizeof(int64_t) * (size_t)(view->n - k - 1));
        view->n--;
        return;
    }
    if (vec_push(view, i) < 0) {
        *stale = 1;
        return;
    }
    memmove(view->v + k + 1, view->v + k, sizeof(int64_t) * (size_t)(view->n - 1 - k));
    view->v[k] = i;
}

static int relocate(search_t *s, int64_t i, int64_t src, int64_t dst) {
    /* Room first: a failed allocation must leave the sample where bin_of says it is. */
    if (vec_push(&s->members[dst], i) < 0) return -1;
    view_update(s, &s->bin_sorted[src], &s->bin_stale[src], i, 1, tokens_up);
    view_update(s, &s->bin_sorted[dst], &s->bin_stale[dst], i, 0, tokens_up);
    int64_t rs = src / s->per, rd = dst / s->per;
    if (rs != rd) {
        view_update(s, &s->rank_sorted[rs], &s->rank_stale[rs], i, 1, cost_up);
        view_update(s, &s->rank_sorted[rd], &s->rank_stale[rd], i, 0, cost_up);
    }
    s->members[dst].n--;
    vec_remove(&s->members[src], i);
    s->members[dst].v[s->members[dst].n++] = i;
    s->bin_of[i] = dst;
    int64_t t = s->tok[i];
    double c = s->cost[i];
    s->bin_tok[src] -= t;
    s->bin_tok[dst] += t;
    s->bin_cnt[src] -= 1;
    s->bin_cnt[dst] += 1;
    s->bin_cost[src] -= c;
    s->bin_cost[dst] += c;
    s->load[src / s->per] -= c;
    s->load[dst / s->per] += c;
    return 0;
}

int search_relocate(search_t *s, int64_t i, int64_t dst) {
    return relocate(s, i, s->bin_of[i], dst);
}

/* Sort sample indices by `before` (a strict total order), bottom-up merge sort via `tmp`. */
static void sort_samples(const search_t *s, int64_t *a, Py_ssize_t n, int64_t *tmp,
                         before_t before) {
    int64_t *src = a, *dst = tmp;
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = before(s, src[j], src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a) memcpy(a, src, sizeof(int64_t) * (size_t)n);
}

/* (-cost, index) ascending: the exchange's heavy candidates. */
int cost_down(const search_t *s, int64_t i, int64_t j) {
    double ci = s->cost[i], cj = s->cost[j];
    return ci > cj || (ci == cj && i < j);
}

/* Room for exactly n entries in vec (its contents undefined); -1 when out of memory. */
static int vec_resize(vec_t *vec, Py_ssize_t n) {
    if (n > vec->cap) {
        Py_ssize_t cap = n < 8 ? 8 : n;
        int64_t *v = (int64_t *)realloc(vec->v, sizeof(int64_t) * (size_t)cap);
        if (v == NULL) return -1;
        vec->v = v;
        vec->cap = cap;
    }
    vec->n = n;
    return 0;
}

static Py_ssize_t rank_count(const search_t *s, int64_t r) {
    Py_ssize_t m = 0;
    for (Py_ssize_t b = r * s->per; b < (r + 1) * s->per; b++) m += s->members[b].n;
    return m;
}

/* Rank r's samples by (cost, index), re-sorted only when stale; NULL when out of memory.
   Sorting uses s->ic as scratch. */
const vec_t *rank_by_cost(search_t *s, int64_t r) {
    vec_t *view = &s->rank_sorted[r];
    if (s->rank_stale[r]) {
        if (vec_resize(view, rank_count(s, r)) < 0) return NULL;
        rank_samples(s, r, view->v);
        sort_samples(s, view->v, view->n, s->ic, cost_up);
        s->rank_stale[r] = 0;
    }
    return view;
}

/* Bin b's samples by (tokens, index), likewise. */
const vec_t *bin_by_tokens(search_t *s, int64_t b) {
    vec_t *view = &s->bin_sorted[b];
    if (s->bin_stale[b]) {
        const vec_t *members = &s->members[b];
        if (vec_resize(view, members->n) < 0) return NULL;
        if (members->n) memcpy(view->v, members->v, sizeof(int64_t) * (size_t)members->n);
        sort_samples(s, view->v, view->n, s->ic, tokens_up);
        s->bin_stale[b] = 0;
    }
    return view;
}

/* Apply a change; returns the partner rank, or -2 when out of memory. */
static int64_t apply_change(search_t *s, const change_t *c) {
    Py_ssize_t per = s->per;
    int64_t x, y;
    switch (c->kind) {
    case MOVE:
        y = c->b;
        x = s->bin_of[c->a];
        if (relocate(s, c->a, x, y) < 0) return -2;
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    case SHIFT_MOVE: /* never with budgets (cheap does not offer it then) */
        y = s->bin_of[c->b];
        if (relocate(s, c->b, y, c->c) < 0) return -2;
        if (relocate(s, c->a, s->bin_of[c->a], y) < 0) return -2;
        return y / per;
    case SWAP:
        x = s->bin_of[c->a];
        y = s->bin_of[c->b];
        if (relocate(s, c->a, x, y) < 0 || relocate(s, c->b, y, x) < 0) return -2;
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    case EXCHANGE: {
        x = s->bin_of[c->a];
        y = s->bin_of[s->xlight[c->b]];
        if (relocate(s, c->a, x, y) < 0) return -2;
        for (int64_t k = c->b; k < c->c; k++) {
            if (relocate(s, s->xlight[k], y, x) < 0) return -2;
        }
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    }
    case BIN_SWAP: {
        x = c->a;
        y = c->b;
        mark_stale(s, x);
        mark_stale(s, y);
        vec_t held = s->members[x];
        s->members[x] = s->members[y];
        s->members[y] = held;
        for (Py_ssize_t k = 0; k < s->members[x].n; k++) s->bin_of[s->members[x].v[k]] = x;
        for (Py_ssize_t k = 0; k < s->members[y].n; k++) s->bin_of[s->members[y].v[k]] = y;
        int64_t ti = s->bin_tok[x]; s->bin_tok[x] = s->bin_tok[y]; s->bin_tok[y] = ti;
        ti = s->bin_cnt[x]; s->bin_cnt[x] = s->bin_cnt[y]; s->bin_cnt[y] = ti;
        double td = s->bin_cost[x]; s->bin_cost[x] = s->bin_cost[y]; s->bin_cost[y] = td;
        for (Py_ssize_t k = 0; k < s->nbud; k++) {
            td = s->bin_bud[x * s->nbud + k];
            s->bin_bud[x * s->nbud + k] = s->bin_bud[y * s->nbud + k];
            s->bin_bud[y * s->nbud + k] = td;
        }
        double moved = s->bin_cost[y] - s->bin_cost[x];
        s->load[x / per] -= moved;
        s->load[y / per] += moved;
        return y / per;
    }
    default:
        return -1;
    }
}

static inline int lighter(const double *load, int64_t p, int64_t q) {
    return load[p] < load[q] || (load[p] == load[q] && p < q);
}

/* Partner sets of an attempt on rank a, from its lighter ranks by (load, rank): the
   NEAR_TARGETS lightest; the next WIDE_TARGETS; every other lighter rank (in larger groups,
   once the first two sets are all the lighter ranks there are within reach). */
typedef enum { NEAR, WIDE, FAR } partners_t;

typedef struct {
    family_t family;
    partners_t partners;
} entry_t;

/* The first phase's table, tried in order until one family finds a change, which is applied:
   the cheap families on the lightest ranks first, the costly shifted move last among them;
   then, before giving up on a, moves and one-for-run exchanges with the wider set; last,
   moves and bin swaps with every other lighter rank. */
static const entry_t PHASE1[] = {
    {move_family, NEAR},         {swap_family, NEAR},     {exchange_family, NEAR},
    {shifted_move_family, NEAR}, {shifted_move_family, WIDE}, {exchange_family, WIDE},
    {move_family, FAR},
};

/* One attempt of the first phase on rank a (an improve_t, see _drive.h): the partner rank
   changed, -1 when a admits no improving change, -2 when out of memory. */
static int64_t improve(search_t *s, int64_t a) {
    double top = s->load[a];
    double tol = attempt_tolerance(top);
    Py_ssize_t count = s->ranks;
    Py_ssize_t reach = NEAR_TARGETS + (s->sumsq ? 0 : WIDE_TARGETS);
    Py_ssize_t want = count - 1 > reach ? reach : count;
    /* The first `want` ranks by (load, rank), ascending (insertion into a short list). */
    int64_t *order = s->order;
    Py_ssize_t held = 0;
    for (int64_t r = 0; r < count; r++) {
        if (held == want && !lighter(s->load, r, order[held - 1])) continue;
        Py_ssize_t k = held < want ? held++ : held - 1;
        while (k > 0 && lighter(s->load, r, order[k - 1])) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = r;
    }
    Py_ssize_t size = 0;
    while (size < held && s->load[order[size]] < top - tol) size++;
    if (size == 0) return -1;
    Py_ssize_t nh = rank_samples(s, a, s->heavy);
    Py_ssize_t far = -1; /* the FAR set's size, once built (after the ranks above) */
    change_t change;
    for (size_t e = 0; e < sizeof(PHASE1) / sizeof(PHASE1[0]); e++) {
        const int64_t *targets = order;
        Py_ssize_t nt = size < NEAR_TARGETS ? size : NEAR_TARGETS;
        if (PHASE1[e].partners == WIDE) {
            targets = order + NEAR_TARGETS;
            nt = size > NEAR_TARGETS ? size - NEAR_TARGETS : 0;
        } else if (PHASE1[e].partners == FAR) {
            if (far < 0) {
                far = 0;
                if (size == held && want < count) {
                    for (int64_t r = 0; r < count && far < s->n; r++) {
                        if (s->load[r] < top - tol && lighter(s->load, order[held - 1], r)) {
                            order[held + far++] = r;
                        }
                    }
                }
            }
            targets = order + held;
            nt = far;
        }
        if (nt == 0 || !((s->families >> e) & 1)) continue;
        int found = PHASE1[e].family(s, a, s->heavy, nh, targets, nt, tol, &change);
        if (found < 0) return -2;
        if (found) return apply_change(s, &change);
    }
    return -1;
}

int64_t improve_attempt(void *s, int64_t a) { return improve((search_t *)s, a); }
