#!/usr/bin/env python3
"""Creates the venv the Python client's tests run in, and installs this checkout's package into it.

  python3 make_venv.py --venv BUILD/python-venv      (CTest's python_client_venv fixture)

Run it with the system python3. The requirements, the build ones included, are read from
python/pyproject.toml and fetched from PyPI only when the venv lacks them; a PyPI that cannot be
reached then is a loud failure, never a skip. The package itself is rebuilt and reinstalled on every
run, so the tests always see the current client and stubs generated from the current proto; it is
built without isolation from the build requirements already in the venv, so that rerun needs no
network.
"""
import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent


def requirements() -> list[str]:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())
    return (project["build-system"]["requires"] + project["project"]["dependencies"] +
            project["project"]["optional-dependencies"]["test"])


def pip(python: Path, *args: str, quiet_failure: bool = False) -> bool:
    command = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    return subprocess.run(command, capture_output=quiet_failure).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", required=True, type=Path)
    venv = parser.parse_args().venv.resolve()
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    needed = requirements()
    # --no-index succeeds exactly when every requirement, at its pinned version, is installed.
    if not pip(python, "install", "--no-index", *needed, quiet_failure=True):
        print(f"make_venv: pip install {' '.join(needed)} into {venv}", flush=True)
        if not pip(python, "install", *needed):
            sys.exit(f"make_venv: FAILED to install {needed} from PyPI (is it reachable?). "
                     "The Python client tests need them.")
    if not pip(python, "install", "--no-build-isolation", "--no-deps", "--force-reinstall",
               str(PACKAGE)):
        sys.exit(f"make_venv: FAILED to build and install the tailserve package from {PACKAGE}")
    print(f"make_venv: tailserve installed into {venv}")


if __name__ == "__main__":
    main()
