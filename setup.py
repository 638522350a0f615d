"""Optional compiled part (gpucache/_jpeg_regions.c): region decode, the restart-marker transcoder,
the restart scan and segment decode.

Built when a C compiler and the libjpeg headers are there (Debian: ``apt-get install gcc
libjpeg-dev``); otherwise the package installs without it, everything else works, and only
``restart_markers=True`` at build time reports what is missing (crops then decode through
nvImageCodec when installed, else in full; same output). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - no compiler: install without the extension
            self.warn(
                f"gpucache: the region decoder and restart-marker transcoder were not "
                f"built ({err}); restart_markers=True will be unavailable"
            )

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001 - no libjpeg headers
            self.warn(
                f"gpucache: {ext.name} was not built ({err}); "
                "restart_markers=True will be unavailable"
            )


setup(
    ext_modules=[
        Extension(
            "gpucache._jpeg_regions",
            ["gpucache/_jpeg_regions.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
