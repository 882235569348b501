"""Sessions for the ttnpu monorepo.

Every session installs from the committed ``uv.lock`` (``uv sync --frozen``) into its own venv, so
the tests run against exactly the versions users get. ``tests-<package>`` syncs only that package,
its own dependencies and its ``test`` group: this proves each library installs and works alone.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PACKAGES = {
    "ft": ROOT / "packages" / "ft",
    "sdc": ROOT / "packages" / "sdc",
    "routing": ROOT / "packages" / "routing",
    "dsv4": ROOT / "packages" / "dsv4",
    "trainer": ROOT / "integration",
}
SOURCES = [str((path / "src").relative_to(ROOT)) for path in PACKAGES.values()]
# Examples written for several processes, with their launcher; the others run as `python FILE`.
LAUNCHERS = {"titan_fsdp_ep.py": ("torchrun", "--standalone", "--nproc_per_node", "2")}
# Extras a package's examples need beyond the package itself.
EXAMPLE_EXTRAS = {"dsv4": ("torchtitan",)}
# What each wheel's METADATA must say (beyond what `twine check` demands).
METADATA = (
    "License-Expression: Apache-2.0",
    "License-File: LICENSE",
    "Author: ttnpu developers",
    "Description-Content-Type: text/markdown",
    "Keywords: ",
    "Classifier: ",
)
nox.options.sessions = ["lint", *(f"tests-{name}" for name in PACKAGES), "e2e"]


def _sync(session: nox.Session, *args: str) -> None:
    """Install from the lock into this session's venv (not the project's .venv), compiled to
    bytecode: where PYTHONDONTWRITEBYTECODE is set (container images), every process would
    otherwise compile torch's and torchtitan's sources anew, 14 of a trainer's 20 s start-up."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--no-default-groups",
        "--compile-bytecode",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _has_tests(path: Path) -> bool:
    return any((path / "tests").rglob("test_*.py"))


def _has_code(path: Path) -> bool:
    return any(p.name != "__init__.py" for p in (path / "src").rglob("*.py"))


def _examples(path: Path) -> list[Path]:
    return sorted((path / "examples").glob("*.py"))


def _check_readmes_and_licenses(session: nox.Session) -> None:
    """Each package's LICENSE is the root's; each README's Python blocks are its example files,
    verbatim, and it shows or names every one of them (what a reader copies is what runs)."""
    license_text = (ROOT / "LICENSE").read_bytes()
    for path in PACKAGES.values():
        here = path.relative_to(ROOT)
        if (path / "LICENSE").read_bytes() != license_text:
            session.error(f"{here}/LICENSE differs from the root LICENSE")
        readme = (path / "README.md").read_text()
        blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.S | re.M)
        examples = {p.read_text() for p in _examples(path)}
        for block in blocks:
            if block not in examples:
                first = block.splitlines()[0] if block else ""
                session.error(
                    f"{here}/README.md: a python block is no file of {here}/examples/ (make it "
                    f"one, verbatim; `nox -s examples` runs them): {first}"
                )
        for example in _examples(path):
            if f"examples/{example.name}" not in readme and example.read_text() not in blocks:
                session.error(f"{here}/README.md neither shows nor names examples/{example.name}")


def _run_examples(session: nox.Session, name: str, bin_dir: Path) -> None:
    """Run every example of ``name`` with the interpreter (and launchers) of ``bin_dir``, in a
    scratch folder (what an example writes stays out of the clone)."""
    scratch = Path(session.create_tmp()).resolve() / f"examples-{name}"
    scratch.mkdir(exist_ok=True)
    with session.chdir(scratch):
        for example in _examples(PACKAGES[name]):
            launcher, *args = LAUNCHERS.get(example.name, ("python",))
            session.run(
                str(bin_dir / launcher),
                *args,
                str(example),
                env={"OMP_NUM_THREADS": "1"},
                external=True,
            )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (which also bans imports between the four libraries), mypy over every src/, and the
    READMEs' examples and LICENSE copies checked against their files."""
    _check_readmes_and_licenses(session)
    _sync(session, "--all-packages", "--group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *SOURCES)


@nox.session
@nox.parametrize("name", list(PACKAGES))
def examples(session: nox.Session, name: str) -> None:
    """Every README example (``<package>/examples/*.py``), in a venv holding only its package."""
    _check_readmes_and_licenses(session)
    extras = [arg for extra in EXAMPLE_EXTRAS.get(name, ()) for arg in ("--extra", extra)]
    _sync(session, "--package", f"ttnpu-{name}", *extras)
    _run_examples(session, name, Path(session.bin))


def _tests(session: nox.Session, name: str) -> None:
    path = PACKAGES[name]
    if not _has_tests(path):
        if _has_code(path):
            session.error(f"{path.relative_to(ROOT)} has code but no tests")
        session.skip(f"{path.relative_to(ROOT)} has no code and no tests yet")
    _sync(session, "--package", f"ttnpu-{name}", "--group", "test")
    session.run(
        "pytest",
        str(path / "tests"),
        "-m",
        "not e2e and not npu",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


def _tests_session(name: str) -> None:
    def session(session: nox.Session) -> None:
        _tests(session, name)

    session.__doc__ = (
        f"ttnpu-{name}'s unit tests, in a venv holding only ttnpu-{name} and its deps."
    )
    nox.session(name=f"tests-{name}", tags=["tests"])(session)


for _name in PACKAGES:
    _tests_session(_name)


@nox.session
def e2e(session: nox.Session) -> None:
    """The multi-process end-to-end tests of integration/ (real processes, real Lighthouse)."""
    tests = ROOT / "integration" / "tests"
    if not any("pytest.mark.e2e" in p.read_text() for p in tests.rglob("test_*.py")):
        session.skip("integration/tests has no e2e tests yet")
    _sync(session, "--package", "ttnpu-trainer", "--group", "test")
    # the slowest tests named in CI's log: where its time goes
    session.run("pytest", str(tests), "-m", "e2e", "--durations=20", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every package's benchmark (``python -m ttnpu.<name>.bench``); each prints one JSON line."""
    _sync(session, "--all-packages", "--all-extras", "--group", "dev")
    for name, path in PACKAGES.items():
        if (path / "src" / "ttnpu" / name / "bench.py").exists():
            session.run("python", "-m", f"ttnpu.{name}.bench", *session.posargs)


@nox.session
def rehearse(session: nox.Session) -> None:
    """DeepSeek-V4 Flash's training step on 128 ranks, rehearsed on this CPU with fake tensors
    (``tools/rehearse.py``): 4K tokens with FSDP, 1M tokens on CP 128 (first and last rank);
    3, 6 and 8 minutes of CPU."""
    _sync(session, "--all-packages", "--group", "dev")
    runs = [
        ["--seq-len", "4096", "--cp", "1", "--rank", "0"],
        ["--seq-len", "1048576", "--cp", "128", "--rank", "0"],
        ["--seq-len", "1048576", "--cp", "128", "--rank", "127"],
    ]
    for run in runs:
        session.run(
            "python", "tools/rehearse.py", "--config", "dsv4_flash", "--world-size", "128",
            "--ac", "full", *run, *session.posargs,
        )  # fmt: skip


@nox.session
def npu(session: nox.Session) -> None:
    """The NPU tests, for real, on an Ascend machine; elsewhere a recording fake stood in."""
    toolkit = os.environ.get("ASCEND_HOME_PATH") or "/usr/local/Ascend"
    if not Path(toolkit).exists() or shutil.which("npu-smi") is None:
        session.skip(
            "no Ascend NPU here (no CANN toolkit or npu-smi): the NPU code paths were tested "
            "against the recording fake of torch_npu in the tests-* sessions"
        )
    _sync(session, "--all-packages", "--all-extras", "--group", "dev")
    session.run(
        "pytest", *(str(p / "tests") for p in PACKAGES.values()), "-m", "npu", *session.posargs
    )


def _check_wheel(session: nox.Session, wheel: Path) -> None:
    """LICENSE (the root's) and the metadata fields of :data:`METADATA` inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        if not licenses or archive.read(licenses[0]) != (ROOT / "LICENSE").read_bytes():
            session.error(f"{wheel.name}: no LICENSE, or not the root's, in its .dist-info")
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    lines = metadata.decode().splitlines()
    if missing := [f for f in METADATA if not any(line.startswith(f) for line in lines)]:
        session.error(f"{wheel.name}: METADATA lacks {missing}")


def _check_sdist(session: nox.Session, sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        if not any(n.count("/") == 1 and n.endswith("/LICENSE") for n in archive.getnames()):
            session.error(f"{sdist.name}: no LICENSE at its top")


@nox.session
def release(session: nox.Session) -> None:
    """Build the five wheels and sdists (``uv build --all-packages``), validate their metadata
    (``twine check --strict``, LICENSE and the fields of METADATA), then install each wheel alone
    into an empty venv (its dependencies at the lock's versions; the other ttnpu wheels from the
    build) and run its examples there."""
    _sync(session, "--only-group", "release")
    work = Path(session.create_tmp()).resolve()
    dist = work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--out-dir", str(dist), external=True)
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.glob("ttnpu_*")))
    constraints = work / "constraints.txt"
    session.run(
        "uv", "export", "--frozen", "--all-packages", "--all-extras", "--no-hashes",
        "--no-emit-workspace", "--no-default-groups", "--output-file", str(constraints),
        external=True, silent=True,
    )  # fmt: skip
    for name in PACKAGES:
        (wheel,) = dist.glob(f"ttnpu_{name}-*.whl")
        (sdist,) = dist.glob(f"ttnpu_{name}-*.tar.gz")
        _check_wheel(session, wheel)
        _check_sdist(session, sdist)
        venv = work / f"venv-{name}"
        shutil.rmtree(venv, ignore_errors=True)
        base = Path(session.bin) / "python"
        session.run("uv", "venv", "--quiet", "--python", str(base), str(venv), external=True)
        python = venv / "bin" / "python"
        extras = ",".join(EXAMPLE_EXTRAS.get(name, ()))
        requirement = f"ttnpu-{name}{f'[{extras}]' if extras else ''} @ {wheel.as_uri()}"
        session.run(
            "uv", "pip", "install", "--quiet", "--python", str(python), "--find-links", str(dist),
            "--constraints", str(constraints), requirement, external=True,
        )  # fmt: skip
        probe = f"import ttnpu.{name} as m; print(m.__name__, m.__version__, m.__file__)"
        # -W ignore: torch warns that numpy is missing (none of these packages needs it)
        out = session.run(str(python), "-W", "ignore", "-c", probe, external=True, silent=True)
        if not out or str(venv) not in out:
            session.error(f"ttnpu.{name} did not import from the wheel's venv: {out}")
        session.log(out.strip())
        _run_examples(session, name, venv / "bin")
