// The Python module object for jax_mlpo._native. Its kernels are exported as C symbols and
// loaded with ctypes (which releases the GIL around each call); this only makes the shared
// library importable so that the import system, editable installs included, can locate it.
#include <Python.h>

static struct PyModuleDef jax_mlpo_native_module = {
    PyModuleDef_HEAD_INIT, "_native", "jax_mlpo native kernels (loaded with ctypes).", -1,
    nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&jax_mlpo_native_module); }
