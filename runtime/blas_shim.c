// The BLAS and LAPACK symbols libmlx imports (`nm -D --undefined-only libmlx.so`), each a
// jump to the same routine of the OpenBLAS that pip installs (scipy-openblas32), which
// exports them only under a "scipy_" prefix. runtime/backend.py loads that OpenBLAS and
// then this library, both with RTLD_GLOBAL, before MLX: libmlx's (and our kernels')
// cblas_sgemm then resolves here instead of MLX's bundled reference BLAS.
//
// A jump, not a C call: the callee gets the caller's registers and stack untouched, so no
// prototype is needed (LAPACK's hidden Fortran string lengths included). The scipy_
// symbols stay undefined here; the dynamic linker binds them to the OpenBLAS loaded first.
// Both are LP64 (32-bit integers), as MLX's reference BLAS is; scipy-openblas64 is ILP64
// and would not fit.

#define MLXGW_BLAS_SYMBOLS(X)                                                              \
  X(cblas_sgemm)                                                                           \
  X(cblas_dgemm)                                                                           \
  X(cblas_cgemm)                                                                           \
  X(sgeev_)                                                                                \
  X(dgeev_)                                                                                \
  X(cgeev_)                                                                                \
  X(sgesdd_)                                                                               \
  X(dgesdd_)                                                                               \
  X(cgesdd_)                                                                               \
  X(ssyevd_)                                                                               \
  X(dsyevd_)                                                                               \
  X(cheevd_)                                                                               \
  X(sgeqrf_)                                                                               \
  X(dgeqrf_)                                                                               \
  X(sorgqr_)                                                                               \
  X(dorgqr_)                                                                               \
  X(sgetrf_)                                                                               \
  X(dgetrf_)                                                                               \
  X(sgetri_)                                                                               \
  X(dgetri_)                                                                               \
  X(spotrf_)                                                                               \
  X(dpotrf_)                                                                               \
  X(strtri_)                                                                               \
  X(dtrtri_)

#if defined(__linux__) && defined(__x86_64__)
#define MLXGW_JUMP(name) "jmp scipy_" #name "@PLT\n"
#elif defined(__linux__) && defined(__aarch64__)
#define MLXGW_JUMP(name) "b scipy_" #name "\n"
#endif

#ifdef MLXGW_JUMP
#define MLXGW_FORWARD(name)                                                                \
  __asm__(".text\n"                                                                        \
          ".globl " #name "\n"                                                             \
          ".type " #name ", %function\n"                                                   \
          #name ":\n"                                                                      \
          MLXGW_JUMP(name)                                                                 \
          ".size " #name ", .-" #name "\n");
MLXGW_BLAS_SYMBOLS(MLXGW_FORWARD)
#endif

// What runtime/backend.py checks before it trusts the library: 1 where the jumps above
// exist (x86-64 and aarch64 Linux), 0 where this file compiled to nothing.
__attribute__((visibility("default"))) int mlxgw_blas_shim_forwards(void) {
#ifdef MLXGW_JUMP
  return 1;
#else
  return 0;
#endif
}
