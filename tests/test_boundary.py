"""Where the user's code ends: the same answer in a virtualenv, a system install and an
editable install (``terra.boundary``).

The unit tests draw the boundary from hand-written installations. The install tests run a
real interpreter of each kind in a child process, with packages put where each kind puts
them (a virtualenv made here, the interpreter it was made from, an editable project, a
``.pth`` path, a zipped egg, a ``--target`` folder): the child loads ``terra/boundary.py``
alone (no TensorFlow there) and says which files are a library's.
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from terra import boundary
from terra.boundary import Installation, decide, roots

BOUNDARY = Path(boundary.__file__)


def _touch(path, text="X = 1\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _verdict(inst, path):
    return decide(os.path.realpath(path), roots(inst))


def _editable(site, project, name="proj"):
    """What ``pip install -e`` writes for a project: its metadata saying it is editable
    (PEP 610), and a ``.pth`` putting its source folder on the path."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": project.as_uri(), "dir_info": {"editable": True}}))
    (site / f"__editable__.{name}-0.1.pth").write_text(str(project / "src") + "\n")


def test_site_packages_pth_paths_eggs_and_target_folders_are_libraries(tmp_path):
    site = tmp_path / "venv/lib/python3.11/site-packages"
    system = tmp_path / "usr/lib/python3/dist-packages"
    extra = tmp_path / "vendored"
    (site / "x.pth").parent.mkdir(parents=True)
    (site / "x.pth").write_text(f"# a comment\nimport os\n{extra}\n")
    egg = tmp_path / "eggs/old-1.0-py3.11.egg"
    egg.parent.mkdir()
    zipfile.ZipFile(egg, "w").writestr("old/__init__.py", "")
    target = tmp_path / "target"
    (target / "dep-1.0.dist-info").mkdir(parents=True)
    user = tmp_path / "work/train.py"
    inst = Installation(path=(str(site), str(system), str(egg), str(target), str(user.parent)),
                        stdlib=(str(tmp_path / "usr/lib/python3.11"),), site_dirs=(str(site),))
    assert _verdict(inst, _touch(site / "pytest/__init__.py"))
    assert _verdict(inst, _touch(system / "absl/app.py"))
    assert _verdict(inst, _touch(extra / "vendored_lib.py"))
    assert _verdict(inst, _touch(target / "dep/__init__.py"))
    assert _verdict(inst, _touch(tmp_path / "usr/lib/python3.11/os.py"))
    assert _verdict(inst, str(egg / "old/__init__.py"))
    assert not _verdict(inst, _touch(user))
    assert not _verdict(inst, _touch(tmp_path / "work/models/net.py"))


def test_an_editable_project_is_the_users_even_inside_a_pth_path(tmp_path):
    site = tmp_path / "venv/lib/python3.11/site-packages"
    project = tmp_path / "myproject"
    _editable(site, project)
    inst = Installation(path=(str(site), str(project / "src")), stdlib=(),
                        site_dirs=(str(site),), editable=(str(project),))
    assert not _verdict(inst, _touch(project / "src/proj/layers.py"))
    assert _verdict(inst, _touch(site / "keras/__init__.py"))


def test_a_virtualenv_inside_the_project_is_a_library_there(tmp_path):
    project = tmp_path / "myproject"
    site = project / ".venv/lib/python3.11/site-packages"
    inst = Installation(path=(str(site), str(project)), stdlib=(), site_dirs=(str(site),),
                        editable=(str(project),))
    assert _verdict(inst, _touch(site / "sonnet/__init__.py"))
    assert not _verdict(inst, _touch(project / "train.py"))


def test_the_switches_move_the_boundary_either_way(tmp_path):
    site = tmp_path / "site-packages"
    framework = _touch(site / "mytrainer/loop.py")
    library = _touch(tmp_path / "work/vendor/fastlib.py")
    single = _touch(site / "helper.py")
    base = dict(path=(str(site),), stdlib=(), site_dirs=(str(site),))
    inst = Installation(**base)
    assert _verdict(inst, framework) and _verdict(inst, single)
    assert not _verdict(inst, library)
    inst = Installation(**base, user_code=(str(framework.parent), str(single)),
                        library_code=(str(library.parent),))
    assert not _verdict(inst, framework) and not _verdict(inst, single)
    assert _verdict(inst, library)
    assert _verdict(inst, _touch(site / "other/mod.py"))  # only what was marked moved


def test_configure_redraws_the_boundary(tmp_path, monkeypatch):
    import terra

    here = __file__
    assert not boundary.is_library(here)
    monkeypatch.syspath_prepend(str(Path(here).parent))
    try:
        terra.configure(library_code="test_boundary")
        assert boundary.is_library(here)
        terra.configure(library_code=[str(Path(here).parent)], user_code=[here])
        assert not boundary.is_library(here)
    finally:
        terra.configure(library_code=(), user_code=())
    assert not boundary.is_library(here)


# -- real interpreters ------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import importlib, importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("boundary_alone", sys.argv[1])
    boundary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boundary)
    drawn = boundary.roots(boundary.Installation.current())
    files = {name: importlib.import_module(name).__file__ for name in sys.argv[3:]}
    files["<script>"] = __file__ if "__file__" in globals() else sys.argv[2]
    files["<user file>"] = sys.argv[2]
    print(json.dumps({name: [f, boundary.decide(os.path.realpath(f), drawn)]
                      for name, f in files.items()}))
""")


def _ask(python, tmp_path, modules, env=None):
    script = tmp_path / "ask.py"
    script.write_text(_CHILD)
    user_file = _touch(tmp_path / "work/train.py")
    proc = subprocess.run([str(python), str(script), str(BOUNDARY), str(user_file), *modules],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path / "work",
                          env={**os.environ, "PYTHONNOUSERSITE": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _base_python():
    """The interpreter this one was made from (this one, outside a virtualenv)."""
    return Path(getattr(sys, "_base_executable", sys.executable) or sys.executable)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtualenv made from the base interpreter, with a package installed in it
    (as pip lays one out), a ``.pth`` path, a zipped egg and an editable project."""
    root = tmp_path_factory.mktemp("fresh")
    env = root / "venv"
    subprocess.run([str(_base_python()), "-m", "venv", "--without-pip", str(env)], check=True,
                   timeout=120)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _touch(site / "installedpkg/__init__.py")
    (site / "installedpkg-1.0.dist-info").mkdir()
    _touch(root / "vendored/pthpkg/__init__.py")
    egg = root / "eggpkg-1.0-py3.11.egg"
    zipfile.ZipFile(egg, "w").writestr("eggpkg/__init__.py", "X = 1\n")
    (site / "extra.pth").write_text(f"{root / 'vendored'}\n{egg}\n")
    project = root / "myproject"
    _touch(project / "src/devpkg/__init__.py")
    _editable(site, project, "devpkg")
    return python


def test_in_a_fresh_virtualenv(venv, tmp_path):
    got = _ask(venv, tmp_path, ["json", "installedpkg", "pthpkg", "eggpkg", "devpkg"])
    assert {name: library for name, (_, library) in got.items()} == {
        "json": True, "installedpkg": True, "pthpkg": True, "eggpkg": True,
        "devpkg": False, "<script>": False, "<user file>": False}, got


def test_in_the_interpreter_a_virtualenv_was_made_from(tmp_path):
    got = _ask(_base_python(), tmp_path, ["json", "pip"])
    assert {name: library for name, (_, library) in got.items()} == {
        "json": True, "pip": True, "<script>": False, "<user file>": False}, got


def test_in_this_interpreter_installed_test_tools_are_libraries(tmp_path):
    """The suite's own interpreter (a virtualenv or not): pytest and numpy are a library's,
    Terra's editable checkout and its tests are the user's side of the boundary."""
    got = _ask(sys.executable, tmp_path, ["pytest", "numpy"])
    assert got["pytest"][1] and got["numpy"][1], got
    assert not got["<user file>"][1], got
    assert not decide(os.path.realpath(__file__), roots(Installation.current()))


def test_a_target_folder_on_pythonpath(tmp_path):
    target = tmp_path / "target"
    _touch(target / "targetpkg/__init__.py")
    (target / "targetpkg-1.0.dist-info").mkdir()
    got = _ask(sys.executable, tmp_path, ["targetpkg"], env={"PYTHONPATH": str(target)})
    assert got["targetpkg"][1], got
