// The Python module object for jax_mlpo._native_cuda (the CUDA copy handlers, loaded with ctypes
// only when a GPU backend is present). Like module.cc, it only makes the library importable.
#include <Python.h>

static struct PyModuleDef jax_mlpo_native_cuda_module = {
    PyModuleDef_HEAD_INIT, "_native_cuda", "jax_mlpo CUDA copy handlers (loaded with ctypes).", -1,
    nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native_cuda(void) { return PyModule_Create(&jax_mlpo_native_cuda_module); }
