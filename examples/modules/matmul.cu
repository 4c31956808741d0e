// The CUDA C twin of matmul.py: the same tiled single-precision matrix multiply, C = A @ B (row-major, A m x k,
// B k x n), for tiles of 8, 16 and 32, each an extern "C" kernel of the name and parameters matmul.py declares
// (a, b, c pointers; m, n, k as long long). A block of TILE x TILE threads computes a tile of C, walking k in
// steps of TILE through two tiles in shared memory. The CUDA backend compiles it with NVRTC when a client loads
// the module (cuLibraryLoadData), and launches each kernel on grid (ceil(n / TILE), ceil(m / TILE)).
template <int TILE>
__device__ __forceinline__ void matmul_tiled(const float *a, const float *b, float *c, long long m, long long n,
                                             long long k) {
    __shared__ float as[TILE][TILE];
    __shared__ float bs[TILE][TILE];
    const long long row = (long long)blockIdx.y * TILE + threadIdx.y;
    const long long col = (long long)blockIdx.x * TILE + threadIdx.x;
    float sum = 0.0f;
    for (long long t = 0; t < k; t += TILE) {
        const long long ak = t + threadIdx.x, bk = t + threadIdx.y;
        as[threadIdx.y][threadIdx.x] = (row < m && ak < k) ? a[row * k + ak] : 0.0f;
        bs[threadIdx.y][threadIdx.x] = (bk < k && col < n) ? b[bk * n + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TILE; ++i) sum = fmaf(as[threadIdx.y][i], bs[i][threadIdx.x], sum);
        __syncthreads();
    }
    if (row < m && col < n) c[row * n + col] = sum;
}

extern "C" __global__ void matmul_t8(const float *a, const float *b, float *c, long long m, long long n,
                                     long long k) {
    matmul_tiled<8>(a, b, c, m, n, k);
}

extern "C" __global__ void matmul_t16(const float *a, const float *b, float *c, long long m, long long n,
                                      long long k) {
    matmul_tiled<16>(a, b, c, m, n, k);
}

extern "C" __global__ void __launch_bounds__(1024) matmul_t32(const float *a, const float *b, float *c, long long m,
                                                              long long n, long long k) {
    matmul_tiled<32>(a, b, c, m, n, k);
}
