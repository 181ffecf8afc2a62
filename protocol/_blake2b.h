/* BLAKE2b (RFC 7693), keyed or unkeyed, any digest size up to 64 bytes: one definition for the
 * two extensions that hash with it (protocol/_speedups.c: the stream's seals of algorithm 0;
 * replicas/_snapshot.c: the snapshot checksums). Kept in C, not taken from a library: Python's
 * BLAKE2b is not reachable from C, OpenSSL 3.0's has no 16-byte digest, and one hashlib call a
 * record costs 1,258 ns against 215 here (docs/decisions.md). Held equal to hashlib.blake2b at
 * every length around its 128-byte blocks by tests/test_speedups.py. */
#ifndef TAPE_BLAKE2B_H
#define TAPE_BLAKE2B_H
#include <stdint.h>
#include <string.h>

/* --- BLAKE2b (RFC 7693), unkeyed, any digest size up to 64 bytes ------------------------- */

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const unsigned char *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);  /* one load */
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
#endif
}

#define B2_G(a, b, c, d, x, y)                 \
    do {                                       \
        a = a + b + (x); d = rotr64(d ^ a, 32); \
        c = c + d;       b = rotr64(b ^ c, 24); \
        a = a + b + (y); d = rotr64(d ^ a, 16); \
        c = c + d;       b = rotr64(b ^ c, 63); \
    } while (0)

/* One 128-byte block into h; `t` counts the bytes hashed through this block. */
static inline void b2_compress(uint64_t h[8], const unsigned char *block, uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) v[i] = h[i], v[i + 8] = B2_IV[i];
    v[12] ^= t;  /* records are far shorter than 2^64 bytes: the counter's high word stays 0 */
    if (last) v[14] = ~v[14];
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 12  /* the message schedule's indices become constants: a fifth faster */
#endif
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B2_G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B2_G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B2_G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B2_G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B2_G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B2_G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B2_G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The state after a key's block, for the last few keys used (a stream has one signing key, two in
 * a rotation): the key block is one compression of the twelve of a 1,400-byte packet, so a seal or
 * its check costs a twelfth less. Per thread, so that no lock is needed wherever it is called. */
#define B2_KEYED_CACHED 4
typedef struct {
    unsigned char key[64];
    size_t keylen, outlen;  /* keylen 0: an empty entry */
    uint64_t h[8];
} B2Keyed;
static _Thread_local B2Keyed b2_keyed[B2_KEYED_CACHED];
static _Thread_local int b2_keyed_next;

static inline void b2_init(uint64_t h[8], size_t keylen, size_t outlen) {
    for (int i = 0; i < 8; i++) h[i] = B2_IV[i];
    h[0] ^= 0x01010000ULL ^ (keylen << 8) ^ outlen;
}

/* h after the key's block (keylen 1..64), compressed as a block that more input follows. */
static inline void b2_keyed_start(uint64_t h[8], const unsigned char *key, size_t keylen, size_t outlen) {
    for (int i = 0; i < B2_KEYED_CACHED; i++) {
        B2Keyed *e = &b2_keyed[i];
        if (e->keylen == keylen && e->outlen == outlen && memcmp(e->key, key, keylen) == 0) {
            memcpy(h, e->h, sizeof e->h);
            return;
        }
    }
    unsigned char block[128] = {0};
    memcpy(block, key, keylen);
    b2_init(h, keylen, outlen);
    b2_compress(h, block, 128, 0);
    B2Keyed *e = &b2_keyed[b2_keyed_next];
    b2_keyed_next = (b2_keyed_next + 1) % B2_KEYED_CACHED;
    memcpy(e->key, key, keylen);
    e->keylen = keylen, e->outlen = outlen;
    memcpy(e->h, h, sizeof e->h);
}

/* BLAKE2b with an `outlen`-byte digest of the concatenation of `nparts` byte strings, keyed with
 * `key` (keylen 1..64) or unkeyed (keylen 0): a key is a zero-padded first block (RFC 7693, 3.3). */
static inline void blake2b_keyed_parts(unsigned char *out, size_t outlen, const unsigned char *key, size_t keylen,
                                int nparts, const unsigned char **part, const size_t *len) {
    uint64_t h[8];
    unsigned char block[128];
    size_t fill = 0, total = 0;
    uint64_t t = 0;
    for (int p = 0; p < nparts; p++) total += len[p];
    if (keylen && total) {  /* the key's block is not the last: its state may be the one cached */
        b2_keyed_start(h, key, keylen, outlen);
        t = 128;
    } else {
        b2_init(h, keylen, outlen);
        if (keylen) {  /* the key's block alone, the last block */
            memset(block, 0, 128);
            memcpy(block, key, keylen);
            fill = 128;
        }
    }
    for (int p = 0; p < nparts; p++) {
        const unsigned char *in = part[p];
        size_t left = len[p];
        while (left) {
            if (fill == 128) {  /* a full block is compressed only once more input follows it */
                t += 128;
                b2_compress(h, block, t, 0);
                fill = 0;
            }
            size_t n = left < 128 - fill ? left : 128 - fill;
            memcpy(block + fill, in, n);
            fill += n, in += n, left -= n;
        }
    }
    memset(block + fill, 0, 128 - fill);
    b2_compress(h, block, t + fill, 1);
    for (size_t i = 0; i < outlen; i++) out[i] = (unsigned char)(h[i / 8] >> (8 * (i % 8)));
}

static inline void blake2b_parts(unsigned char *out, size_t outlen, int nparts, const unsigned char **part,
                          const size_t *len) {
    blake2b_keyed_parts(out, outlen, NULL, 0, nparts, part, len);
}

#endif
