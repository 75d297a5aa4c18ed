"""The CRC-32 of two byte strings joined, from the CRC-32 of each:
`crc(a + b) = crc(a) * x^(8 len(b)) + crc(b)` modulo zlib's polynomial.

Example:
>>> combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
True
"""

__all__ = ["combine"]

# zlib's polynomial, bit-reversed: bit 31 is the coefficient of x^0.
_POLY = 0xEDB88320
_ONE = 1 << 31  # the polynomial 1


def _multiply(a, b):
    """`a * b` modulo the polynomial, both bit-reversed."""
    product = 0
    bit = _ONE
    while bit:
        if a & bit:
            product ^= b
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b * x
    return product


_SQUARES = [_ONE >> 1]  # x^(2^k) for every bit of 8 * a 64-bit length
while len(_SQUARES) < 67:
    _SQUARES.append(_multiply(_SQUARES[-1], _SQUARES[-1]))


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of `a + b`, given `crc32(a)`, `crc32(b)` and `len(b)`."""
    if length_b < 0 or length_b >= 1 << 64:
        raise ValueError(
            f"A length in bytes is 0 to 2**64 - 1. Received: {length_b}"
        )
    shift, bits, k = _ONE, 8 * length_b, 0
    while bits:
        if bits & 1:
            shift = _multiply(_SQUARES[k], shift)
        bits >>= 1
        k += 1
    return _multiply(shift, crc_a) ^ crc_b
