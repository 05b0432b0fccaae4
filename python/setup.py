"""Generates the tailserve.v1 gRPC stubs from the repository's proto while the package is built.

Nothing generated is committed, so the stubs cannot drift from proto/tailserve/v1/generation.proto:
every `pip install ./python` regenerates them (README.md says why this beats committed stubs).
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# The proto's path under the include root is its import path: protoc names the generated modules
# tailserve/v1/generation_pb2*.py, which is exactly where they belong in this package.
PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
PROTO = PROTO_ROOT / "tailserve" / "v1" / "generation.proto"
SOURCES = Path(__file__).resolve().parent / "src"


class BuildPyWithStubs(build_py):
    """build_py, then protoc writes generation_pb2{,_grpc}.py and .pyi beside the copied sources."""

    def run(self) -> None:
        super().run()
        # Editable installs import from src/, so the stubs go there (git-ignored); wheels get them
        # in build_lib.
        generate_stubs(SOURCES if self.editable_mode else Path(self.build_lib))


def generate_stubs(out: Path) -> None:
    """Runs grpcio-tools' bundled protoc (a build requirement) on the repository's proto."""
    from grpc_tools import protoc

    if not PROTO.is_file():
        raise SystemExit(
            f"tailserve: {PROTO} not found. The stubs are generated from the repository's proto, "
            "so build from a checkout (pip install ./python), not an sdist or a copied folder.")
    args = ["grpc_tools.protoc", f"--proto_path={PROTO_ROOT}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"tailserve: grpc_tools.protoc failed on {PROTO}")


setup(cmdclass={"build_py": BuildPyWithStubs})
