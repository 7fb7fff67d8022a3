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
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* Hashed right after its copy, piece by piece, while the piece is still in the cache. */
#define PIECE ((size_t)256 << 10)

/* For each i < n: len[i] bytes from src[i] to dst[i] (src NULL: dst is hashed in place),
 * ok[i] = 1 when the low 32 bits of XXH3-64(dst[i], seed) equal want[i], else 0, where
 * seed is XXH3-64 of the seed_len[i] bytes at seed_src[i] when that is not NULL (the
 * frame's header and key: hashed here too, so that no call per value gives the GIL up),
 * else seed[i]. Returns 0, or -1 when no hash state could be made (nothing copied). */
int ucm_rowcopy(size_t n, char *const *dst, const char *const *src, const size_t *len,
                const uint64_t *seed, const char *const *seed_src, const size_t *seed_len,
                const uint32_t *want, const struct xxh3_api *api, uint8_t *ok)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = seed[i];
        if (seed_src[i] != NULL) {
            api->reset(state, 0);
            api->update(state, seed_src[i], seed_len[i]);
            s = api->digest(state);
        }
        api->reset(state, s);
        for (size_t at = 0; at < len[i]; at += PIECE) {
            size_t k = len[i] - at < PIECE ? len[i] - at : PIECE;
            if (src != NULL && src[i] != NULL)
                memcpy(dst[i] + at, src[i] + at, k);
            api->update(state, dst[i] + at, k);
        }
        ok[i] = (uint32_t)api->digest(state) == want[i];
    }
    api->free_state(state);
    return 0;
}

/* A row of values scattered into pages elsewhere (a KV cache's blocks) and verified, in one
 * call: for each value i < n, its len[i] bytes at src[i] are pages of page bytes each.
 * Page j of value i goes to the page whose start is dst_page[first[i] + j] (0: not
 * written, a page the destination already holds), as nruns runs: run_len[r] bytes from
 * page + run_src[r] to the page's start + run_dst[r]. Each page is hashed from the source
 * right before its runs are copied, while it is in the cache; the runs of a value whose
 * checksum (as in ucm_rowcopy) turns out wrong have been written all the same: ok[i] = 0
 * tells the caller those pages hold nothing usable. The caller checked every address
 * (the destination pages against the cache's blocks, the runs against a page). Returns 0,
 * or -1 when no hash state could be made (nothing copied). */
int ucm_rowscatter(size_t n, const char *const *src, const size_t *len, const uint64_t *seed,
                   const char *const *seed_src, const size_t *seed_len, const uint32_t *want,
                   size_t page, const size_t *first, char *const *dst_page, size_t nruns,
                   const size_t *run_src, const size_t *run_dst, const size_t *run_len,
                   const struct xxh3_api *api, uint8_t *ok)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = seed[i];
        if (seed_src[i] != NULL) {
            api->reset(state, 0);
            api->update(state, seed_src[i], seed_len[i]);
            s = api->digest(state);
        }
        api->reset(state, s);
        size_t pages = page ? len[i] / page : 0;
        for (size_t j = 0; j < pages; j++) {
            const char *from = src[i] + j * page;
            api->update(state, from, page);
            char *to = dst_page[first[i] + j];
            if (to == NULL)
                continue;
            for (size_t r = 0; r < nruns; r++)
                memcpy(to + run_dst[r], from + run_src[r], run_len[r]);
        }
        if (pages * page < len[i]) /* a tail that is no page: hashed, never copied */
            api->update(state, src[i] + pages * page, len[i] - pages * page);
        ok[i] = (uint32_t)api->digest(state) == want[i];
    }
    api->free_state(state);
    return 0;
}

/* A batch of values copied into a store and framed, in one call: for each i < n, len[i]
 * bytes from src[i] to dst[i], piece by piece, each piece hashed right after its copy
 * (as ucm_rowcopy does), and digest[i] = XXH3-64 of the copy, seeded as in ucm_rowcopy.
 * The caller builds each frame's header from it. Returns 0, or -1 when no hash state
 * could be made (nothing copied). */
int ucm_rowframe(size_t n, char *const *dst, const char *const *src, const size_t *len,
                 const char *const *seed_src, const size_t *seed_len,
                 const struct xxh3_api *api, uint64_t *digest)
{
    void *state = api->create();
    if (state == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        api->reset(state, 0);
        api->update(state, seed_src[i], seed_len[i]);
        api->reset(state, api->digest(state));
        for (size_t at = 0; at < len[i]; at += PIECE) {
            size_t k = len[i] - at < PIECE ? len[i] - at : PIECE;
            memcpy(dst[i] + at, src[i] + at, k);
            api->update(state, dst[i] + at, k);
        }
        digest[i] = api->digest(state);
    }
    api->free_state(state);
    return 0;
}
