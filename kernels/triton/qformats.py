"""The GGML quantized types the kernels read: type ids (as in ggml.h / gguf-py) and block layouts.
One table for the dequantizer of raw GGUF rows (qdequant.py), the load-time repack (qpack.py) and
the decode GEMV (qmatmul.py)."""

Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 6, 8, 12, 13, 14

# GGML type id -> (name, values per block, bytes per block)
LAYOUT = {
    Q4_0: ("Q4_0", 32, 18),  # d f16, 16 B of 4-bit quants
    Q5_0: ("Q5_0", 32, 22),  # d f16, 4 B of high bits, 16 B of low nibbles
    Q8_0: ("Q8_0", 32, 34),  # d f16, 32 int8 quants
    Q4_K: ("Q4_K", 256, 144),  # d, dmin f16, 12 B of 6-bit scales/mins, 128 B of 4-bit quants
    Q5_K: ("Q5_K", 256, 176),  # d, dmin f16, 12 B of scales/mins, 32 B of high bits, 128 B of low nibbles
    Q6_K: ("Q6_K", 256, 210),  # 128 B of low nibbles, 64 B of high 2 bits, 16 int8 scales, d f16
}
