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
