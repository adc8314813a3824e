"""vmm_py_test: a py_test that runs pytest on one test file."""

def vmm_py_test(name, src, deps = [], **kwargs):
    native.py_test(
        name = name,
        srcs = [src, "run_pytest.py", "conftest.py"],
        main = "run_pytest.py",
        args = ["$(location %s)" % src],
        python_version = "PY3",
        deps = deps + ["//torch_plugin:vmm_torch"],
        **kwargs
    )
