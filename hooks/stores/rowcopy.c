/* A row's values copied and verified in one call (hooks/stores/rowcopy.py builds and
 * loads this file with the host's C compiler; the store runs without it, slower beside a
 * busy interpreter).
 *
 * Why C: a Python thread that copies and hashes a value gives the GIL up for each copy
 * and each checksum, and beside vLLM's forward (a thread that keeps the GIL) every take
 * back waits up to the switch interval. One call here per row of values gives it up once.
 *
 * The checksum is the store's frame check (hooks/stores/framing.py): XXH3-64 of the
 * payload, seeded per value, low 32 bits. The XXH3 functions are passed in by address,
 * taken from the xxhash extension the store already imports, so nothing is linked here. */
#define _GNU_SOURCE /* pthread_setname_np */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *);
typedef int (*xxh3_reset_fn)(void *, uint64_t);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);

struct xxh3_api {
    xxh3_create_fn create;
    xxh3_free_fn free_state;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
};

/* Start a value's checksum: seeded with ``seed``, or with XXH3-64 of the ``seed_len`` bytes
 * at ``seed_src`` when that is not NULL (the frame's header and key). */
static void start_value(void *state, const struct xxh3_api *api, uint64_t seed,
                        const char *seed_src, size_t seed_len)
{
    if (seed_src != NULL) {
        api->reset(state, 0);
        api->update(state, seed_src, seed_len);
        seed = api->digest(state);
    }
    api->reset(state, seed);
}

static void copy_run(char *to, const char *from, size_t n);
static void copy_run_ahead(char *to, const char *from, size_t n, const char *ahead);
static void store_fence(void);

/* A value checked in place (no source) is hashed in pieces of this size. */
#define PIECE ((size_t)256 << 10)
/* A value copied is hashed from its source a piece at a time, and the piece then copied
 * from the cache it was just read into (128 KiB: within any x86 core's L2). */
#define COPY_PIECE ((size_t)128 << 10)

/* Where the piece after the one at ``at`` of value i starts (the next value's first when
 * value i ends there), NULL after the last: what copy_run_ahead prefetches. */
static const char *next_piece(size_t n, const char *const *src, const size_t *len, size_t i,
                              size_t at)
{
    if (at < len[i])
        return src[i] + at;
    for (i++; i < n; i++)
        if (src[i] != NULL && len[i] > 0)
            return src[i];
    return NULL;
}

/* For each i < n: len[i] bytes from src[i] to dst[i] (src NULL: dst is hashed in place),
 * ok[i] = 1 when the low 32 bits of XXH3-64 of those bytes, seeded, equal want[i], else
 * 0, where the seed is XXH3-64 of the seed_len[i] bytes at seed_src[i] when that is not
 * NULL (the frame's header and key: hashed here too, so that no call per value gives the
 * GIL up), else seed[i]. Returns 0, or -1 when no hash state could be made (nothing
 * copied).
 *
 * A copied value is hashed from the source and written around the caches (copy_run), as
 * ucm_rowframe and ucm_scatter do, not copied and then hashed from the copy. Why: a
 * store's segment is a shared mapping of small pages, and a plain memcpy of a piece of it
 * followed by a pass over the copy took twice the time of a plain memcpy of the value
 * (2 MiB: 390 us against 200 on this project's host), where hashing the source and
 * streaming the piece out takes about the memcpy's time: the value is read from memory
 * once, and the copy's lines are not read before they are written. What the check then
 * covers is the source: a source rewritten between a piece's hash and its copy is a
 * segment emptied meanwhile, which the caller's generation check after the copy turns
 * into a miss (hooks/stores/local_reads.py), as it does for a torn copy. */
int ucm_rowcopy(size_t n, char *const *dst, const char *const *src, const size_t *len,
                const uint64_t *seed, const char *const *seed_src, const size_t *seed_len,
                const uint32_t *want, const struct xxh3_api *api, uint8_t *ok)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        start_value(state, api, seed[i], seed_src[i], seed_len[i]);
        if (src != NULL && src[i] != NULL) {
            for (size_t at = 0; at < len[i]; at += COPY_PIECE) {
                size_t k = len[i] - at < COPY_PIECE ? len[i] - at : COPY_PIECE;
                api->update(state, src[i] + at, k);
                copy_run(dst[i] + at, src[i] + at, k);
            }
        } else {
            for (size_t at = 0; at < len[i]; at += PIECE) {
                size_t k = len[i] - at < PIECE ? len[i] - at : PIECE;
                api->update(state, dst[i] + at, k);
            }
        }
        ok[i] = (uint32_t)api->digest(state) == want[i];
    }
    store_fence(); /* the streamed bytes visible before the caller hands them on */
    api->free_state(state);
    return 0;
}

/* A run into a KV cache or a store's segment: written around the caches (non-temporal
 * stores) when it is long. Why: those pages are written once here and read later (by the
 * forward, by another process), not now, so
 * pulling each destination line into the cache first (what a plain store does) reads as
 * many bytes from memory as are written; a large memcpy streams, a 64 KiB one does not.
 * The caller fences (store_fence) before telling a reader the bytes are there. */
#define STREAM_MIN ((size_t)4096)
#if defined(__SSE2__)
#include <emmintrin.h>
/* The one streaming loop of copy_run and copy_run_ahead (below): called with a constant
 * NULL, the prefetch folds away. */
static inline __attribute__((always_inline)) void stream_run(char *to, const char *from,
                                                              size_t n, const char *ahead)
{
    if (n < STREAM_MIN) {
        memcpy(to, from, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)to & 15)) & 15;
    memcpy(to, from, head);
    to += head;
    from += head;
    n -= head;
    for (; n >= 64; n -= 64, to += 64, from += 64) {
        if (ahead != NULL) {
            _mm_prefetch(ahead, _MM_HINT_T1);
            ahead += 64;
        }
        __m128i a = _mm_loadu_si128((const __m128i *)from);
        __m128i b = _mm_loadu_si128((const __m128i *)(from + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(from + 48));
        _mm_stream_si128((__m128i *)to, a);
        _mm_stream_si128((__m128i *)(to + 16), b);
        _mm_stream_si128((__m128i *)(to + 32), c);
        _mm_stream_si128((__m128i *)(to + 48), d);
    }
    memcpy(to, from, n);
}
static void copy_run(char *to, const char *from, size_t n) { stream_run(to, from, n, NULL); }
static void store_fence(void) { _mm_sfence(); }
/* copy_run, and meanwhile the n bytes at ahead (NULL: none) fetched into the core's L2,
 * a line per line copied: the next piece's hash then reads them from there. Why: a
 * piece is hashed from memory and then streamed out from the cache, so while it is
 * copied the core reads nothing from memory, and the hash of the next one waits for
 * its lines (the hardware prefetcher stops at each 4 KiB page). A prefetch never
 * faults, so a piece shorter than n (a value's last) costs nothing past its end.
 * Measured on this project's 2-core host, 128 values of 1 MiB from 64 MiB of sources
 * into a tmpfs mapping: ucm_rowframe (32 KiB pieces) 12.5-12.9 GB/s before, 14.4-15.3
 * after. ucm_rowcopy's 128 KiB pieces and ucm_scatter's pages were no faster with it
 * (get into buffers 15.8 GB/s before, 12-12.8 after; the load proxy's wall unchanged),
 * so only the frame uses it. */
static void copy_run_ahead(char *to, const char *from, size_t n, const char *ahead)
{
    if (ahead == NULL)
        stream_run(to, from, n, NULL);
    else
        stream_run(to, from, n, ahead);
}
#else
static void copy_run(char *to, const char *from, size_t n) { memcpy(to, from, n); }
static void copy_run_ahead(char *to, const char *from, size_t n, const char *ahead)
{
    (void)ahead;
    memcpy(to, from, n);
}
static void store_fence(void) {}
#endif

/* Values scattered into pages elsewhere (a KV cache's blocks) and verified, in one call.
 * For each value i < n, its len[i] bytes at src[i] are pages of its plan p = plan_of[i]:
 * page_bytes[p] each, copied as run_count[p] runs from run_first[p] on (run_len[r] bytes
 * from page + run_src[r] to the page's start + run_dst[r]). Page j of value i starts at
 * dst_page[first[i] + j] (NULL: not written, a page the destination already holds). Each
 * page is hashed from the source right before its runs are copied, while it is in the
 * cache; the runs of a value whose checksum (as in ucm_rowcopy) turns out wrong have been
 * written all the same: ok[i] = 0 tells the caller those pages hold nothing usable.
 *
 * Marks (rows of a KV cache, done one by one while the forward waits for each): mark m is
 * set, flags[mark_flag[m]] = 1 with release order, as soon as the values before
 * mark_end[m] are done (marks in order of mark_end); every mark is set before returning.
 * A reader that sees its flag set sees those values' bytes.
 *
 * The caller checked every address (the destination pages against the cache's blocks,
 * the runs against a page). Returns 0, or -1 when no hash state could be made (nothing
 * copied, no mark set). */
int ucm_scatter(size_t n, const char *const *src, const size_t *len, const uint64_t *seed,
                const char *const *seed_src, const size_t *seed_len, const uint32_t *want,
                const size_t *plan_of, const size_t *page_bytes, const size_t *run_first,
                const size_t *run_count, const size_t *run_src, const size_t *run_dst,
                const size_t *run_len, const size_t *first, char *const *dst_page,
                size_t nmarks, const size_t *mark_end, const size_t *mark_flag, uint8_t *flags,
                const struct xxh3_api *api, uint8_t *ok)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    size_t m = 0;
    while (m < nmarks && mark_end[m] == 0)
        __atomic_store_n(&flags[mark_flag[m++]], 1, __ATOMIC_RELEASE);
    for (size_t i = 0; i < n; i++) {
        start_value(state, api, seed[i], seed_src[i], seed_len[i]);
        size_t p = plan_of[i], page = page_bytes[p];
        size_t r0 = run_first[p], r1 = r0 + run_count[p];
        size_t pages = page ? len[i] / page : 0;
        for (size_t j = 0; j < pages; j++) {
            const char *from = src[i] + j * page;
            api->update(state, from, page);
            char *to = dst_page[first[i] + j];
            if (to == NULL)
                continue;
            for (size_t r = r0; r < r1; r++)
                copy_run(to + run_dst[r], from + run_src[r], run_len[r]);
        }
        if (pages * page < len[i]) /* a tail that is no page: hashed, never copied */
            api->update(state, src[i] + pages * page, len[i] - pages * page);
        ok[i] = (uint32_t)api->digest(state) == want[i];
        if (m < nmarks && mark_end[m] <= i + 1)
            store_fence(); /* the streamed bytes visible before the mark */
        while (m < nmarks && mark_end[m] <= i + 1)
            __atomic_store_n(&flags[mark_flag[m++]], 1, __ATOMIC_RELEASE);
    }
    store_fence();
    while (m < nmarks)
        __atomic_store_n(&flags[mark_flag[m++]], 1, __ATOMIC_RELEASE);
    api->free_state(state);
    return 0;
}

/* Wait, without the caller's interpreter lock (ctypes gives it up for the call), until
 * *flag is set or timeout_ns passed: 1 when set. Polls every 20 microseconds: a row of a
 * KV cache takes milliseconds, a sleep in the kernel would wake later than that. */
int ucm_wait_flag(const uint8_t *flag, int64_t timeout_ns)
{
    struct timespec nap = {0, 20000}, now, until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ns / 1000000000;
    until.tv_nsec += timeout_ns % 1000000000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000;
    }
    for (;;) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE))
            return 1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > until.tv_sec || (now.tv_sec == until.tv_sec && now.tv_nsec >= until.tv_nsec))
            return 0;
        nanosleep(&nap, NULL);
    }
}

/* A framing batch's value is hashed and copied a piece of this size at a time
 * (ucm_rowframe, below). */
#define FRAME_PIECE ((size_t)32 << 10)

/* Value i of a framing batch: copied, hashed from its source, digest[i] set. */
static void frame_value(void *state, const struct xxh3_api *api, size_t n, char *const *dst,
                        const char *const *src, const size_t *len,
                        const char *const *seed_src, const size_t *seed_len,
                        uint64_t *digest, size_t i)
{
    api->reset(state, 0);
    api->update(state, seed_src[i], seed_len[i]);
    api->reset(state, api->digest(state));
    for (size_t at = 0; at < len[i]; at += FRAME_PIECE) {
        size_t k = len[i] - at < FRAME_PIECE ? len[i] - at : FRAME_PIECE;
        api->update(state, src[i] + at, k);
        copy_run_ahead(dst[i] + at, src[i] + at, k, next_piece(n, src, len, i, at + k));
    }
    digest[i] = api->digest(state);
}

/* A detached thread of a small stack running main, with every signal blocked (signals
 * stay with the interpreter's threads): 1 when it was made. The copier and the checksum
 * helper (below) are made so, once per process. */
static int start_detached(void *(*main)(void *))
{
    pthread_attr_t attr;
    pthread_t thread;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, (size_t)256 << 10);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int made = pthread_create(&thread, &attr, main, NULL) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return made;
}

/* ---- The copier: a put's framing on one more thread, inside the put's call ---------
 *
 * Why: beside vLLM's forward (a thread that keeps the interpreter lock) a dump thread
 * begins its native copy only once it got that lock, up to the switch interval (5 ms)
 * after it asked, and a second dump thread often a switch interval or two after the
 * first (docs/CONNECTOR.md, "The copier", has the figures). Meanwhile one thread
 * copied, while the forward left a core's time over. The copier is a thread with no
 * interpreter lock to wait for: it joins a batch at once, and a second batch once the
 * first is framed, so the thread that began late finds part of its batch done.
 *
 * One thread per process (made at first use, like the checksum helper below), woken
 * per batch. A batch in a slot is framed by its caller and the copier together, each
 * taking its next value from the slot's counter, so neither waits for the other to
 * start, and a copier that wakes late (or never: the caller finished first) costs only
 * its wake-up. The copier takes the posted batch with the most values left, then the
 * next. A caller waits, before returning, only for the value the copier is framing of
 * its batch, since the copier reads the caller's buffers. A caller that finds every
 * slot taken frames its batch alone.
 *
 * The copier runs at the priority of the thread that started it (a dump thread's): it
 * is one more thread of a put, sharing the cores with the forward as the dump threads
 * do. At the lowest priority it took only a core nothing else wanted, and beside the
 * forward on a host of few cores that was none: the dump thread that began late still
 * framed its batch alone (docs/CONNECTOR.md, "The copier" has the figures of both). A
 * caller waiting for the value the copier frames sleeps (a few tens of microseconds at
 * a time), so that the copier gets the core if it waits for that one. */
/* Below this a batch is framed by its caller alone: a wake-up costs about what it saves,
 * and a put of a value or two (a full store's, a decode step's row) never waits for a
 * copier that a busier thread has taken the core from. */
#define COPY_MIN_BYTES ((size_t)8 << 20)
#define COPIER_SLOTS 4

enum { COPIER_IDLE, COPIER_FILLING, COPIER_POSTED, COPIER_RUNNING, COPIER_DONE };

struct copier_batch {
    int phase; /* COPIER_*: IDLE, its caller FILLING it, POSTED, the copier RUNNING it or
                  DONE with it (its caller then sets IDLE) */
    size_t n;
    char *const *dst;
    const char *const *src;
    const size_t *len;
    const char *const *seed_src;
    const size_t *seed_len;
    const struct xxh3_api *api;
    uint64_t *digest;
    size_t next; /* the next value to frame, by its caller or the copier */
};

static struct {
    pthread_mutex_t lock; /* guards the wake-up: a slot's phase POSTED and the signal */
    pthread_cond_t wake;
    pid_t pid;  /* the process whose copier thread runs (none after a fork) */
    int failed; /* no thread could be made: never tried again in this process */
    struct copier_batch slot[COPIER_SLOTS];
    uint64_t posted, framed, unstarted; /* batches posted, values it framed, batches it
                                           never began (their callers did them all) */
} copier = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, {{0}}, 0, 0, 0};

static pthread_once_t copier_once = PTHREAD_ONCE_INIT;

/* In a forked child (one thread, the copier left behind): a fresh lock, no copier yet. */
static void copier_forked(void)
{
    pthread_mutex_init(&copier.lock, NULL);
    pthread_cond_init(&copier.wake, NULL);
    copier.pid = 0;
    copier.failed = 0;
    for (int k = 0; k < COPIER_SLOTS; k++)
        copier.slot[k].phase = COPIER_IDLE;
    copier.posted = copier.framed = copier.unstarted = 0;
}

static void copier_register(void) { pthread_atfork(NULL, NULL, copier_forked); }

/* A posted batch taken (POSTED -> RUNNING), the one with the most values left; NULL
 * when none is posted. */
static struct copier_batch *copier_take(void)
{
    for (;;) {
        struct copier_batch *best = NULL;
        size_t most = 0;
        for (int k = 0; k < COPIER_SLOTS; k++) {
            struct copier_batch *b = &copier.slot[k];
            if (__atomic_load_n(&b->phase, __ATOMIC_ACQUIRE) != COPIER_POSTED)
                continue;
            size_t at = __atomic_load_n(&b->next, __ATOMIC_RELAXED);
            size_t left = at < b->n ? b->n - at : 0;
            if (best == NULL || left > most) {
                best = b;
                most = left;
            }
        }
        if (best == NULL)
            return NULL;
        int posted = COPIER_POSTED;
        if (__atomic_compare_exchange_n(&best->phase, &posted, COPIER_RUNNING, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return best;
        /* taken back by its caller meanwhile: look again */
    }
}

static void *copier_main(void *unused)
{
    (void)unused;
    pthread_setname_np(pthread_self(), "ucm-copier");
    void *state = NULL;
    const struct xxh3_api *made = NULL;
    for (;;) {
        struct copier_batch *b = copier_take();
        if (b == NULL) {
            pthread_mutex_lock(&copier.lock);
            while ((b = copier_take()) == NULL)
                pthread_cond_wait(&copier.wake, &copier.lock);
            pthread_mutex_unlock(&copier.lock);
        }
        const struct xxh3_api *api = b->api;
        if (state == NULL || api != made) {
            if (state != NULL)
                made->free_state(state);
            state = api->create();
            made = api;
        }
        while (state != NULL) { /* (no hash state: its caller frames them all) */
            size_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
            if (i >= b->n)
                break;
            frame_value(state, api, b->n, b->dst, b->src, b->len, b->seed_src, b->seed_len,
                        b->digest, i);
            __atomic_add_fetch(&copier.framed, 1, __ATOMIC_RELAXED);
        }
        store_fence(); /* this thread's streamed bytes visible before its caller sees DONE */
        __atomic_store_n(&b->phase, COPIER_DONE, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Whether this process has a copier thread, making it the first time. */
static int copier_started(void)
{
    pid_t me = getpid();
    if (__atomic_load_n(&copier.pid, __ATOMIC_ACQUIRE) == me)
        return 1;
    pthread_once(&copier_once, copier_register);
    pthread_mutex_lock(&copier.lock);
    if (copier.pid != me && !copier.failed) {
        if (start_detached(copier_main))
            __atomic_store_n(&copier.pid, me, __ATOMIC_RELEASE);
        else
            copier.failed = 1;
    }
    int up = copier.pid == me;
    pthread_mutex_unlock(&copier.lock);
    return up;
}

/* Post a batch to the copier: its slot (the caller then takes its values from the
 * slot's counter), or NULL when too small, every slot taken, or no copier. */
static struct copier_batch *copier_post(size_t n, char *const *dst, const char *const *src,
                                        const size_t *len, const char *const *seed_src,
                                        const size_t *seed_len, const struct xxh3_api *api,
                                        uint64_t *digest)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += len[i];
    if (n < 2 || total < COPY_MIN_BYTES || !copier_started())
        return NULL;
    struct copier_batch *b = NULL;
    for (int k = 0; k < COPIER_SLOTS && b == NULL; k++) {
        int idle = COPIER_IDLE;
        if (__atomic_compare_exchange_n(&copier.slot[k].phase, &idle, COPIER_FILLING, 0,
                                        __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            b = &copier.slot[k];
    }
    if (b == NULL)
        return NULL;
    b->n = n;
    b->dst = dst;
    b->src = src;
    b->len = len;
    b->seed_src = seed_src;
    b->seed_len = seed_len;
    b->api = api;
    b->digest = digest;
    __atomic_store_n(&b->next, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&copier.posted, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&copier.lock);
    __atomic_store_n(&b->phase, COPIER_POSTED, __ATOMIC_RELEASE);
    pthread_cond_signal(&copier.wake);
    pthread_mutex_unlock(&copier.lock);
    return b;
}

/* The caller has taken the last value of its batch: take the batch back from a copier
 * that never began it, or wait while the copier frames its last one of it; then the
 * slot is free again, and the copier reads none of the caller's buffers. */
static void copier_let_go(struct copier_batch *b)
{
    int posted = COPIER_POSTED;
    if (__atomic_compare_exchange_n(&b->phase, &posted, COPIER_IDLE, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        __atomic_add_fetch(&copier.unstarted, 1, __ATOMIC_RELAXED);
        return;
    }
    struct timespec nap = {0, 20000};
    for (unsigned spins = 0; __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE) != COPIER_DONE;
         spins++) {
        if (spins >= 64)
            nanosleep(&nap, NULL); /* its core to the copier, if that is where it waits */
    }
    __atomic_store_n(&b->phase, COPIER_IDLE, __ATOMIC_RELEASE);
}

/* The copier's counts: out[0] batches posted to it, out[1] values it framed, out[2]
 * batches it never began; out[3] 1 when its thread runs in this process. */
void ucm_copier_stats(uint64_t *out)
{
    out[0] = __atomic_load_n(&copier.posted, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&copier.framed, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&copier.unstarted, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&copier.pid, __ATOMIC_ACQUIRE) == getpid();
}

/* A batch of values copied into a store and framed, in one call: for each i < n, len[i]
 * bytes from src[i] to dst[i], and digest[i] = XXH3-64 of them, seeded as in ucm_rowcopy.
 * The caller builds each frame's header from it. Returns 0, or -1 when no hash state
 * could be made (nothing copied). A batch of COPY_MIN_BYTES or more is shared with the
 * copier (above): the caller's thread and the copier take its values in turn.
 *
 * Each piece is hashed from the source, then copied from the cache it was just read into
 * and written around the caches (copy_run), as ucm_scatter does. Why: a store's segment
 * is written once here and read later by another process, so hashing the copy instead
 * would need its lines in the cache, and a plain store reads each destination line from
 * memory before writing it. Hashed from the source, the value moves through memory once
 * each way. A source changed while it is copied gives a frame whose check fails on read:
 * the value is then reported damaged, never served torn. */
int ucm_rowframe(size_t n, char *const *dst, const char *const *src, const size_t *len,
                 const char *const *seed_src, const size_t *seed_len,
                 const struct xxh3_api *api, uint64_t *digest)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    size_t alone = 0;
    struct copier_batch *shared = copier_post(n, dst, src, len, seed_src, seed_len, api, digest);
    size_t *next = shared != NULL ? &shared->next : &alone;
    for (;;) {
        size_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= n)
            break;
        frame_value(state, api, n, dst, src, len, seed_src, seed_len, digest, i);
    }
    if (shared != NULL)
        copier_let_go(shared);
    store_fence(); /* the streamed bytes visible before the caller publishes them */
    api->free_state(state);
    return 0;
}

/* All of len bytes from buf written at offset of fd, however many pwrite calls that
 * takes (a signal, a short write): 0, or the errno of the one that failed. */
static int write_all(int fd, const char *buf, size_t len, int64_t offset)
{
    while (len > 0) {
        ssize_t n = pwrite(fd, buf, len, (off_t)offset);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return EIO;
        buf += n;
        len -= (size_t)n;
        offset += n;
    }
    return 0;
}

/* ---- The checksum helper: a file put's hashing on a second core -------------------
 *
 * Why: a put into the disk tier is a checksum pass over the payload (XXH3, bound by
 * memory bandwidth: it reads each byte from memory) and a pwrite whose copy into the
 * page cache the kernel makes on the writer's thread. One thread does them one after
 * the other; the checksum is a third of the time. The helper is one thread per process
 * that hashes a batch's values while the writer writes them.
 *
 * The writer never waits for the helper to start: a value the helper has not begun by
 * the time the writer needs its checksum is taken back (QUEUED -> TAKEN) and hashed by
 * the writer. So on a host whose cores are all busy (several writers, the cleaner) the
 * helper rarely runs and nothing is lost but one wake-up per batch; with a core free,
 * the checksum costs the writer nothing. The writer waits only for a value the helper
 * is hashing (RUNNING), because the helper reads the writer's source buffers: no call
 * returns while the helper reads one of its values.
 *
 * One batch at a time: a writer that finds the helper holding another batch (another
 * thread's, or the end of its own previous one) does its batch alone. A batch has two
 * holders, its writer and the helper; each lets go when done with it, the writer without
 * waiting for the helper to have looked at the rest, and the last one frees the jobs
 * for the next batch (so neither reads a job another writer has refilled). */
#define HELP_MAX 64                        /* values of one batch the helper can take */
#define HELP_MIN_BYTES ((size_t)256 << 10) /* below this a wake-up costs what it saves */
#define WRITE_PIECE ((size_t)1 << 20)      /* a core's L2: hashed, then written from it */

enum { JOB_QUEUED, JOB_RUNNING, JOB_DONE, JOB_TAKEN };
enum { HELPER_IDLE, HELPER_FILLING, HELPER_POSTED, HELPER_BUSY };

struct hash_job {
    const char *src;
    size_t len;
    const char *seed_src;
    size_t seed_len;
    uint64_t digest;
    int state;
};

static struct {
    pthread_mutex_t lock; /* guards the wake-up: phase POSTED and the signal */
    pthread_cond_t wake;
    pid_t pid;            /* the process whose helper thread runs (none after a fork) */
    int failed;           /* no thread could be made: never tried again in this process */
    int phase;            /* HELPER_*: whether a batch holds job[] and n */
    int holders;          /* of the batch posted: its writer, the helper (2, 1, 0) */
    size_t n;
    const struct xxh3_api *api;
    struct hash_job job[HELP_MAX];
    uint64_t posted, hashed, taken; /* batches given, values it hashed, values taken back */
} helper = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, HELPER_IDLE, 0, 0,
            NULL, {{0}}, 0, 0, 0};

/* One holder of the posted batch is done with it; the last frees the jobs. */
static void helper_release_batch(void)
{
    if (__atomic_sub_fetch(&helper.holders, 1, __ATOMIC_ACQ_REL) == 0)
        __atomic_store_n(&helper.phase, HELPER_IDLE, __ATOMIC_RELEASE);
}

static pthread_once_t helper_once = PTHREAD_ONCE_INIT;

/* In a forked child (one thread, the helper left behind): a fresh lock, no helper yet. */
static void helper_forked(void)
{
    pthread_mutex_init(&helper.lock, NULL);
    pthread_cond_init(&helper.wake, NULL);
    helper.pid = 0;
    helper.failed = 0;
    helper.phase = HELPER_IDLE;
    helper.holders = 0;
    helper.posted = helper.hashed = helper.taken = 0;
}

static void helper_register(void) { pthread_atfork(NULL, NULL, helper_forked); }

static void *helper_main(void *unused)
{
    (void)unused;
    void *state = NULL;
    const struct xxh3_api *made = NULL;
    for (;;) {
        pthread_mutex_lock(&helper.lock);
        while (__atomic_load_n(&helper.phase, __ATOMIC_ACQUIRE) != HELPER_POSTED)
            pthread_cond_wait(&helper.wake, &helper.lock);
        __atomic_store_n(&helper.phase, HELPER_BUSY, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&helper.lock);
        const struct xxh3_api *api = helper.api;
        if (state == NULL || api != made) {
            if (state != NULL)
                made->free_state(state);
            state = api->create();
            made = api;
        }
        for (size_t i = 0; i < helper.n && state != NULL; i++) {
            struct hash_job *j = &helper.job[i];
            int want = JOB_QUEUED;
            if (!__atomic_compare_exchange_n(&j->state, &want, JOB_RUNNING, 0,
                                             __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                continue; /* taken back by its writer */
            start_value(state, api, 0, j->seed_src, j->seed_len);
            api->update(state, j->src, j->len);
            j->digest = api->digest(state);
            __atomic_store_n(&j->state, JOB_DONE, __ATOMIC_RELEASE);
            __atomic_add_fetch(&helper.hashed, 1, __ATOMIC_RELAXED);
        }
        helper_release_batch();
    }
    return NULL;
}

/* Whether this process has a helper thread, making it the first time. */
static int helper_started(void)
{
    pid_t me = getpid();
    if (__atomic_load_n(&helper.pid, __ATOMIC_ACQUIRE) == me)
        return 1;
    pthread_once(&helper_once, helper_register);
    pthread_mutex_lock(&helper.lock);
    if (helper.pid != me && !helper.failed) {
        if (start_detached(helper_main))
            __atomic_store_n(&helper.pid, me, __ATOMIC_RELEASE);
        else
            helper.failed = 1;
    }
    int up = helper.pid == me;
    pthread_mutex_unlock(&helper.lock);
    return up;
}

/* Give the helper the first values of a batch: how many it was given (0: too small, or
 * the helper busy or not startable). */
static size_t helper_post(size_t n, const char *const *src, const size_t *len,
                          const char *const *seed_src, const size_t *seed_len,
                          const struct xxh3_api *api)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += len[i];
    if (total < HELP_MIN_BYTES)
        return 0;
    int idle = HELPER_IDLE;
    if (!helper_started() ||
        !__atomic_compare_exchange_n(&helper.phase, &idle, HELPER_FILLING, 0,
                                     __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return 0;
    size_t m = n < HELP_MAX ? n : HELP_MAX;
    for (size_t i = 0; i < m; i++) {
        struct hash_job *j = &helper.job[i];
        j->src = src[i];
        j->len = len[i];
        j->seed_src = seed_src[i];
        j->seed_len = seed_len[i];
        j->state = JOB_QUEUED;
    }
    helper.n = m;
    helper.api = api;
    helper.holders = 2;
    __atomic_add_fetch(&helper.posted, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&helper.lock);
    __atomic_store_n(&helper.phase, HELPER_POSTED, __ATOMIC_RELEASE);
    pthread_cond_signal(&helper.wake);
    pthread_mutex_unlock(&helper.lock);
    return m;
}

/* Value i's checksum: the helper's, or, when the helper has not begun it, the writer's
 * own (state: the writer's hash state). Waits only while the helper hashes it. */
static uint64_t helper_digest(size_t i, void *state, const struct xxh3_api *api)
{
    struct hash_job *j = &helper.job[i];
    int want = JOB_QUEUED;
    if (__atomic_compare_exchange_n(&j->state, &want, JOB_TAKEN, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        __atomic_add_fetch(&helper.taken, 1, __ATOMIC_RELAXED);
        start_value(state, api, 0, j->seed_src, j->seed_len);
        api->update(state, j->src, j->len);
        return api->digest(state);
    }
    for (unsigned spins = 0; __atomic_load_n(&j->state, __ATOMIC_ACQUIRE) != JOB_DONE;
         spins++) {
        if (spins >= 64)
            sched_yield();
    }
    return j->digest;
}

/* The values from i on of a batch given to the helper, taken back (or waited for while
 * it hashes them), and the batch let go: after this the helper reads none of the
 * writer's buffers. */
static void helper_let_go(size_t from, size_t given)
{
    if (given == 0)
        return;
    for (size_t i = from; i < given; i++) {
        struct hash_job *j = &helper.job[i];
        int want = JOB_QUEUED;
        if (__atomic_compare_exchange_n(&j->state, &want, JOB_TAKEN, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            continue;
        while (__atomic_load_n(&j->state, __ATOMIC_ACQUIRE) == JOB_RUNNING)
            sched_yield();
    }
    helper_release_batch();
}

/* The helper's counts: out[0] batches given to it, out[1] values it hashed, out[2]
 * values their writers took back; out[3] 1 when its thread runs in this process. */
void ucm_hash_helper_stats(uint64_t *out)
{
    out[0] = __atomic_load_n(&helper.posted, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&helper.hashed, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&helper.taken, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&helper.pid, __ATOMIC_ACQUIRE) == getpid();
}

/* A batch of values written into a file and framed, in one call: for each i < n, the
 * len[i] bytes at src[i] go to fd at pay_at[i], digest[i] = XXH3-64 of them, seeded as in
 * ucm_rowframe; then its low 32 bits go little-endian into head[i] at sum_at[i], and the
 * head_len[i] bytes of head[i] (the record's header) to fd at head_at[i]. A header is
 * written after its payload, so a record whose payload write failed has no valid header.
 *
 * With beside set, the first values go to the checksum helper (above) and are written
 * without hashing; the rest (or all: beside not set, the helper busy) are hashed piece
 * by piece, each piece then written from the cache it was just read into (WRITE_PIECE).
 * The caller sets beside where nothing else of the store works beside its writers (a
 * store with a disk tier only); a two-tier store's spare core belongs to its cleaner,
 * and there a helper per writer would only take turns with it.
 * Returns 0, -1 when no hash state could be made (nothing written), or the errno of a
 * write that failed (what came before it is written; the caller publishes none of the
 * batch). */
int ucm_framewrite(int fd, size_t n, const int64_t *pay_at, const char *const *src,
                   const size_t *len, const char *const *seed_src, const size_t *seed_len,
                   char *const *head, const size_t *head_len, const size_t *sum_at,
                   const int64_t *head_at, const struct xxh3_api *api, uint64_t *digest,
                   int beside)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    size_t given = beside ? helper_post(n, src, len, seed_src, seed_len, api) : 0;
    int err = 0;
    size_t i = 0;
    for (; i < n && err == 0; i++) {
        if (i < given) {
            for (size_t at = 0; at < len[i] && err == 0; at += WRITE_PIECE) {
                size_t k = len[i] - at < WRITE_PIECE ? len[i] - at : WRITE_PIECE;
                err = write_all(fd, src[i] + at, k, pay_at[i] + (int64_t)at);
            }
            if (err != 0)
                break;
            digest[i] = helper_digest(i, state, api);
        } else {
            start_value(state, api, 0, seed_src[i], seed_len[i]);
            for (size_t at = 0; at < len[i] && err == 0; at += WRITE_PIECE) {
                size_t k = len[i] - at < WRITE_PIECE ? len[i] - at : WRITE_PIECE;
                api->update(state, src[i] + at, k);
                err = write_all(fd, src[i] + at, k, pay_at[i] + (int64_t)at);
            }
            if (err != 0)
                break;
            digest[i] = api->digest(state);
        }
        uint32_t sum = (uint32_t)digest[i];
        unsigned char *to = (unsigned char *)head[i] + sum_at[i];
        to[0] = (unsigned char)sum;
        to[1] = (unsigned char)(sum >> 8);
        to[2] = (unsigned char)(sum >> 16);
        to[3] = (unsigned char)(sum >> 24);
        err = write_all(fd, head[i], head_len[i], head_at[i]);
    }
    helper_let_go(i < given ? i : given, given);
    api->free_state(state);
    return err;
}

/* What ucm_frame_send did (its return value). */
#define SEND_ANSWERED 0 /* copied, request sent, its answer readable */
#define SEND_LATE 1     /* copied, request sent, no answer within the timeout */
#define SEND_CUT 2      /* copied; the request could not be written whole: the stream is
                           unusable (errno in *err) */
#define SEND_NOTHING (-1) /* no hash state: nothing copied, nothing sent */

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait until fd is ready for events or deadline_ns (CLOCK_MONOTONIC) passed: 1 ready,
 * 0 not, -1 poll failed (errno set). */
static int wait_fd(int fd, short events, int64_t deadline_ns)
{
    for (;;) {
        int64_t left = deadline_ns - now_ns();
        if (left <= 0)
            return 0;
        struct pollfd p = {fd, events, 0};
        int ms = (int)((left + 999999) / 1000000);
        int got = poll(&p, 1, ms);
        if (got > 0)
            return 1;
        if (got < 0 && errno != EINTR)
            return -1;
    }
}

/* A put's values framed into their segments and its publish request sent, in one call,
 * so that the thread that calls it (a dump thread beside vLLM's forward, which keeps the
 * interpreter lock) takes that lock back once, when the answer is there, not after the
 * copy and again after the answer.
 *
 * For each i < n: as ucm_rowframe (the copy hashed from the source, written around the
 * caches, digest[i]), then the record's header: the head_len bytes at head_src[i] copied
 * to head_dst[i], the low 32 bits of digest[i] little-endian right after them. Then a
 * store fence (every byte and header visible before the request says they are there),
 * then the req_len bytes of req written to the non-blocking req_fd (waiting in poll while
 * the pipe is full), then a wait until ans_fd has something to read; both within
 * timeout_ns. Returns SEND_*. */
int ucm_frame_send(size_t n, char *const *dst, const char *const *src, const size_t *len,
                   const char *const *seed_src, const size_t *seed_len, char *const *head_dst,
                   const char *const *head_src, size_t head_len, const struct xxh3_api *api,
                   uint64_t *digest, int req_fd, const char *req, size_t req_len, int ans_fd,
                   int64_t timeout_ns, int *err)
{
    if (ucm_rowframe(n, dst, src, len, seed_src, seed_len, api, digest) != 0)
        return SEND_NOTHING;
    for (size_t i = 0; i < n; i++) {
        uint32_t sum = (uint32_t)digest[i];
        unsigned char *to = (unsigned char *)head_dst[i];
        memcpy(to, head_src[i], head_len);
        to[head_len] = (unsigned char)sum;
        to[head_len + 1] = (unsigned char)(sum >> 8);
        to[head_len + 2] = (unsigned char)(sum >> 16);
        to[head_len + 3] = (unsigned char)(sum >> 24);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t deadline = now_ns() + timeout_ns;
    while (req_len > 0) {
        ssize_t w = write(req_fd, req, req_len);
        if (w > 0) {
            req += w;
            req_len -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return SEND_CUT;
        }
        int ready = wait_fd(req_fd, POLLOUT, deadline);
        if (ready <= 0) {
            *err = ready < 0 ? errno : ETIMEDOUT;
            return SEND_CUT;
        }
    }
    return wait_fd(ans_fd, POLLIN, deadline) > 0 ? SEND_ANSWERED : SEND_LATE;
}

/* A file's size, for a caller that keeps the interpreter lock (loaded through
 * ctypes.PyDLL): st_size, or -1 when the file has no link left (deleted), or -2 - errno
 * when fstat failed. A memory tier's put or read checks each segment's file once per
 * batch; os.fstat gives the lock up around the call, and beside vLLM's forward, a thread
 * that keeps it, taking it back can wait up to the switch interval, for a call of a
 * microsecond on a tmpfs. */
int64_t ucm_fstat_held(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -2 - (int64_t)errno;
    return st.st_nlink == 0 ? -1 : (int64_t)st.st_size;
}
