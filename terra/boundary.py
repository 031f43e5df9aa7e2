"""Which code is the user's: the boundary of what is installed.

Terra treats the user's code and library code differently: a site (``terra.location``) is
made of the frames from an op's issuer up, the user's line is the innermost user frame, and
only the user's loops count as loops in an iteration. A frame is the user's when its file
is not part of the Python installation: not under the standard library, nor under a folder
packages are installed into (every ``site-packages`` and ``dist-packages`` on the path, a
virtualenv's and the system's, the user site, a ``pip install --target`` folder that holds
distributions' ``.dist-info``), nor a folder a ``.pth`` file put on the path, nor inside a
zipped egg. So pytest, absl, Sonnet, GPflow and a user's installed trainer framework are
library code whatever installed them, and the answer does not depend on whether Python runs
in a virtualenv.

A project installed in editable mode (``pip install -e``: PEP 610's ``direct_url.json``
says ``editable``) stays the user's: its files are the ones being developed. Two switches
move the boundary either way, each a comma-separated list of module names or paths:
``TERRA_USER_CODE`` (``terra.configure(user_code=...)``) marks installed packages as the
user's, ``TERRA_LIBRARY_CODE`` (``library_code=...``) marks the user's own packages as a
library's. The most specific folder decides. TensorFlow's and Terra's own code are always
internal (:func:`is_internal`).
"""

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
import urllib.parse
import urllib.request

# the file name Terra compiles its own code under (``terra.lanes``): Terra's, not the user's
GENERATED = "<terra "

_INSTALL_DIRS = ("site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Installation:
    """What the boundary is drawn from; :meth:`current` reads it off this interpreter, a
    test writes one by hand."""

    path: tuple[str, ...]  # sys.path
    stdlib: tuple[str, ...]  # the standard library's folders
    site_dirs: tuple[str, ...]  # the site directories, whose .pth files extend the path
    editable: tuple[str, ...] = ()  # the project folders of editable installs
    user_code: tuple[str, ...] = ()  # folders or files marked as the user's
    library_code: tuple[str, ...] = ()  # folders or files marked as a library's

    @classmethod
    def current(cls, user_code=(), library_code=()) -> "Installation":
        """This interpreter's; ``user_code``, ``library_code``: the switches' module names
        or paths."""
        stdlib = set()
        for base in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
            paths = sysconfig.get_paths(vars={"base": base, "platbase": base,
                                               "installed_base": base})
            stdlib.update((paths["stdlib"], paths["platstdlib"]))
        site_dirs = list(getattr(site, "getsitepackages", lambda: [])())
        if site.ENABLE_USER_SITE is not False:
            site_dirs.append(site.getusersitepackages())
        return cls(path=tuple(p for p in sys.path if p), stdlib=tuple(sorted(stdlib)),
                   site_dirs=tuple(site_dirs), editable=tuple(_editable_projects()),
                   user_code=tuple(_resolve(user_code)),
                   library_code=tuple(_resolve(library_code)))


def _editable_projects():
    """The project folders of the distributions installed in editable mode (PEP 610)."""
    for dist in importlib.metadata.distributions():
        try:
            text = dist.read_text("direct_url.json")
            info = json.loads(text) if text else {}
        except (OSError, ValueError):
            continue
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file:"):
            yield urllib.request.url2pathname(urllib.parse.urlparse(info["url"]).path)


def _resolve(names):
    """Module names or paths -> paths, without importing anything (a name that is not an
    importable module is taken for a path)."""
    for name in names:
        spec = None
        if os.sep not in name and not name.endswith(".py"):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            yield os.path.abspath(name)
        elif spec.submodule_search_locations:
            yield from spec.submodule_search_locations
        elif spec.origin:
            yield spec.origin


def _pth_paths(site_dir):
    """The folders a site directory's ``.pth`` files add to the path (``import`` lines run
    code and add none)."""
    try:
        names = sorted(n for n in os.listdir(site_dir) if n.endswith(".pth"))
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(site_dir, name), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")):
                yield os.path.join(site_dir, line)


def _holds_distributions(folder):
    try:
        return any(n.endswith(".dist-info") for n in os.listdir(folder))
    except OSError:
        return False


def _folder(path):
    """The prefix of the files under ``path``: a folder or zip with its separator, a single
    module's file as it is."""
    real = os.path.realpath(path)
    return real if real.endswith(".py") and os.path.isfile(real) else real + os.sep


def roots(inst: Installation) -> tuple[tuple[str, bool], ...]:
    """``(folder, is_library)`` pairs, most specific first: a file's first match decides;
    a file under none is the user's."""
    editable = {_folder(p) for p in inst.editable}
    library = set(inst.stdlib) | set(inst.site_dirs)
    for entry in inst.path:
        if os.path.basename(os.path.normpath(entry)) in _INSTALL_DIRS or \
                os.path.isfile(entry) or _holds_distributions(entry):  # a zip, a --target
            library.add(entry)
    for site_dir in inst.site_dirs:  # not an editable project's own folders (a src layout)
        library.update(p for p in _pth_paths(site_dir) if not _folder(p).startswith(
            tuple(editable)))
    found = dict.fromkeys(map(_folder, library), True)
    found.update(dict.fromkeys(editable, False))
    found.update(dict.fromkeys(map(_folder, inst.library_code), True))
    found.update(dict.fromkeys(map(_folder, inst.user_code), False))
    return tuple(sorted(found.items(), key=lambda kv: -len(kv[0])))


def decide(filename: str, drawn) -> bool:
    """Whether the file at real path ``filename`` is a library's, by :func:`roots` ``drawn``."""
    for folder, library in drawn:
        if filename.startswith(folder):
            return library
    return False


@functools.lru_cache(maxsize=1)
def _roots():
    from terra.config import config  # (this module loads without TF: its tests run it alone)

    return roots(Installation.current(config.user_code, config.library_code))


@functools.lru_cache(maxsize=1)
def _internal_dirs():
    """TF's and Terra's own code: the frames between an op's issuer and the op differ between
    tracing (op callbacks) and co-execution (Terra's doors), so sites never include them."""
    import tensorflow

    tf_dir = os.path.dirname(os.path.dirname(tensorflow.__file__)) + os.sep + "tensorflow"
    return (_folder(tf_dir), _folder(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=1024)
def _real_dir(path: str) -> str:
    """A folder's real path: resolved once per folder (a few dozen), not once per file (a
    traced step of TF-Agents' code first meets ~150 files: 8 ms of ``lstat``)."""
    return os.path.realpath(path)


def _real(filename):
    head, tail = os.path.split(filename)
    return os.path.join(_real_dir(head), tail)


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    """Whether code from ``filename`` (a code object's ``co_filename``) is not the user's."""
    if filename.startswith("<"):
        return filename.startswith(("<frozen", GENERATED))
    real = _real(filename)
    return real.startswith(_internal_dirs()) or decide(real, _roots())


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """Whether code from ``filename`` is TensorFlow's or Terra's own."""
    if filename.startswith("<"):
        return filename.startswith(GENERATED)
    return _real(filename).startswith(_internal_dirs())


def forget():
    """Draw the boundary again (the switches changed)."""
    for cached in (_roots, is_library, is_internal):
        cached.cache_clear()
