"""Profile a pipeline into a timeline: ``python profile.py pipeline=chimera stages=8``.

[Note: this file shadows the standard library's ``profile``]
Run from the repository root, ``import profile`` finds this file before the standard library's
module, and ``cProfile`` (imported by ``torch._dynamo``) does ``import profile``. When imported
under that name, this file therefore loads the standard library's ``profile`` and stands in for it,
so ``cProfile`` and everything importing it keep working (tests/test_entry_points.py checks it).
"""

if __name__ == "__main__":
    from pipefisher.cli import profile_main

    profile_main()
else:
    import importlib.util as _util
    import os as _os
    import sysconfig as _sysconfig

    _spec = _util.spec_from_file_location(
        "profile", _os.path.join(_sysconfig.get_paths()["stdlib"], "profile.py")
    )
    _stdlib_profile = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_stdlib_profile)
    globals().update({k: v for k, v in vars(_stdlib_profile).items() if k not in ("__name__", "__file__", "__spec__", "__loader__")})
