"""xlaserve's directory in the user cache, and reading code back from it.

Two things kept there are code: compiled step executables (pickles, the executable store
of engine/executable_store.py) and the CPU kernels' shared library (ops/native). Whoever can change
either runs code as the user who loads it, and their names are keys anyone can compute.
So what xlaserve creates there is private (directories 0700, files 0600), and nothing is
loaded unless the file and every directory from its store's root down to it belong to
this user and no one else can write them (`open_private`). The root is opened once,
following a symbolic link the user may have made; below it nothing is a link, and the file
is read (or dlopen'ed) through the descriptor that was checked, so a path swapped after
the check is never what is loaded.

Directories above the root are not checked: keeping them private (not a shared mount) is
the user's part. Here rather than in engine/ because ops/native, the bottom layer, loads
the library.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


class UntrustedPath(OSError):
    """A file or directory of a cache that this user does not own alone."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = Path(path), reason


def user_cache_dir() -> Path:
    """xlaserve's directory in the user cache ($XDG_CACHE_HOME/xlaserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaserve"


def makedirs_private(path: Path) -> None:
    """`path` and its missing parents, each created 0700 (os.makedirs gives a missing parent
    the default mode); what exists already is left as it is."""
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process
            pass


def private_dir(root: Path, relative: str = "") -> Path:
    """root/relative, its missing directories created 0700, after checking that every
    directory from `root` down is this user's alone; raises UntrustedPath."""
    makedirs_private(root)
    fd = _open_root(Path(root))
    try:
        for part in Path(relative).parts:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            fd = _open_below(fd, Path(root), part, directory=True)
    finally:
        os.close(fd)
    return Path(root, relative)


def open_private(root: Path, relative: str) -> BinaryIO:
    """root/relative opened for reading, after checking that it is a regular file (not a
    link) and that it and every directory from `root` down belong to this user and are not
    writable by group or others. Raises FileNotFoundError when it is absent, UntrustedPath
    (naming the path at fault and why) when a check fails."""
    root = Path(root)
    *dirs, name = Path(relative).parts
    fd = _open_root(root)
    try:
        for part in dirs:
            fd = _open_below(fd, root, part, directory=True)
        file_fd = _open_below(fd, root, name, directory=False, walked=dirs)
    finally:
        os.close(fd)
    return os.fdopen(file_fd, "rb")


def _open_root(root: Path) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check(os.fstat(fd), root, directory=True)
    except UntrustedPath:
        os.close(fd)
        raise
    return fd


def _open_below(parent: int, root: Path, name: str, *, directory: bool,
                walked: list[str] | None = None) -> int:
    """`name` in the directory `parent`, opened without following a link and checked; the
    parent's descriptor is closed when the name is a directory (the walk moves down)."""
    path = Path(root, *(walked or []), name)
    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if directory else os.O_NONBLOCK)
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except OSError as e:  # a link gives ELOOP, or ENOTDIR with O_DIRECTORY
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        raise UntrustedPath(path, "is a symbolic link" if link else "is not a directory") from None
    try:
        _check(os.fstat(fd), path, directory=directory)
    except UntrustedPath:
        os.close(fd)
        raise
    if directory:
        os.close(parent)
    return fd


def _check(st: os.stat_result, path: Path, *, directory: bool) -> None:
    if directory and not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(path, "is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise UntrustedPath(path, "is not a regular file")
    uid = os.getuid()
    if st.st_uid != uid:
        raise UntrustedPath(path, f"is owned by uid {st.st_uid}, not by this user ({uid})")
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others"))
                           if st.st_mode & bit)
        raise UntrustedPath(path, f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})")
