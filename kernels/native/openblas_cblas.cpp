// MLX's Linux CPU wheel calls the reference BLAS it bundles (cblas_sgemm and friends). Preloaded
// after OpenBLAS (the scipy-openblas32 wheel, whose symbols carry a `scipy_` prefix), this library
// gives MLX OpenBLAS's matrix products under the names MLX calls. deformable_detr/runtime.py decides
// whether to preload it; nothing else here is OpenBLAS-specific.

extern "C" {

// OpenBLAS's own declarations, 32-bit integers (scipy-openblas32): the CBLAS enums are ints.
void scipy_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                       int lda, const float* b, int ldb, float beta, float* c, int ldc);
void scipy_cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k, double alpha, const double* a,
                       int lda, const double* b, int ldb, double beta, double* c, int ldc);
void scipy_cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k, const void* alpha, const void* a,
                       int lda, const void* b, int ldb, const void* beta, void* c, int ldc);

__attribute__((visibility("default"))) void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                                        float alpha, const float* a, int lda, const float* b,
                                                        int ldb, float beta, float* c, int ldc) {
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                                        double alpha, const double* a, int lda, const double* b,
                                                        int ldb, double beta, double* c, int ldc) {
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                                        const void* alpha, const void* a, int lda, const void* b,
                                                        int ldb, const void* beta, void* c, int ldc) {
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
}
