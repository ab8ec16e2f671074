"""Who may change a tier's directory: only the user the job runs as.

Whoever can write a tier's root, or a directory on the way to it, can swap what a save writes
or a load reads (a directory renamed away and a symbolic link to another tier put in its
place, names planted before the job makes them), and a RAM tier's ``keep`` would then evict
what that link leads to. The default roots are in ``/dev/shm``, where every local user may
create directories. So the way to a root is walked, one component at a time and by descriptors
(:func:`tierstore_plugins.safe_fs.open_root_dir`), each time the root is opened: at the store's
open (``Backend.check_reachable``, a ConfigError naming the tier), at every save, load and
eviction. It is refused when:

- the root is not owned by this user (by uid; root's own uid 0 is no exception), or every user
  can write it without the sticky bit (``chmod o-w`` fixes it; with the sticky bit, as on
  ``/dev/shm`` itself, others can add names but never rename or remove ours);
- a directory on the way to it can be written by every user without the sticky bit (anyone
  could rename what is below and put something else there);
- a directory or symbolic link on the way sits in a directory every user can write (``/tmp``,
  ``/dev/shm``) and belongs to neither this user nor root: another user made it, and the
  sticky bit lets its owner replace it at any time;
- below the root, a directory a save or an eviction opens belongs to neither this user nor
  root (another user made it first in a root with the sticky bit).

A symbolic link on the way is followed only when it passed those checks (the user's own, or
root's, in a place only trusted users can change, as ``/local_nvme -> /mnt/nvme0``): a link is
never changed in place, only replaced by whoever can write the directory holding it.
Directories only a group can write are trusted, on the way and as the root (project
directories on shared filesystems are made so, and under user private groups, the common umask
002 makes every new directory group-writable: the group is the user). Directories tierstore
makes itself are owner-writable only (``DIR_MODE``).

This module says what is wrong (pure functions of ``os.stat`` results); :mod:`.safe_fs` walks.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

from tierstore.plugin import TierstoreError

__all__ = ["DIR_MODE", "UnsafeDirectoryError", "below_root_fault", "check_open_root", "entry_fault",
           "root_fault", "way_fault"]

#: mode of the directories tierstore makes (the tier root, the places it is made in, the
#: checkpoints' directories): written by the owner only, read as the umask allows
DIR_MODE = 0o755


class UnsafeDirectoryError(TierstoreError, PermissionError):
    """A tier's root, the way to it or a directory in it, that another user could change.
    ``fault`` is the sentence saying which directory, whose it is and what to do. A
    ``TierstoreError`` (what a user catches from the store) and a ``PermissionError`` (what
    the operation met)."""

    def __init__(self, refused: str, fault: str):
        super().__init__(errno.EACCES, f"refusing {refused}: {fault}")
        self.refused, self.fault = refused, fault

    def __reduce__(self):
        # OSError's own would rebuild it from (errno, message), which this one does not take
        # (DCP's checkpoint process and its exceptions travel pickled).
        return type(self), (self.refused, self.fault)

    def __str__(self) -> str:
        return self.strerror  # the sentence alone, without "[Errno 13]"


def entry_fault(path: str, st: os.stat_result, holder: str, holder_st: os.stat_result,
                link_target: str | None = None) -> str | None:
    """Why entry ``path`` (a directory, or a symbolic link to ``link_target``; ``st`` its own
    status, links not followed) in directory ``holder`` (status ``holder_st``) on the way to a
    root could be replaced by another user, or None."""
    me = os.geteuid()
    if link_target is not None and st.st_uid not in (me, 0) and not _everyone_writes(holder_st):
        # A link is a pointer someone chose: whoever owns it chose where the tier goes (the
        # directory holding it may be a group's, or root may have been fooled into making it).
        return (f"{path} is a symbolic link to {link_target} and belongs to "
                f"{_user(st.st_uid)}, not to this user ({_user(me)}) nor to root: tierstore "
                f"follows only links this user or root made. Point the tier at the target "
                f"directory itself, or have the link made by this user")
    if not (_everyone_writes(holder_st) and st.st_uid not in (me, 0)):
        return None
    what = (f"{path} is a symbolic link to {link_target} and belongs to"
            if link_target is not None else f"{path} belongs to")
    return (f"{what} {_user(st.st_uid)}, not to this user ({_user(me)}), and it is in "
            f"{holder}, where every user can create entries: another user made it and can "
            f"replace what tierstore keeps below it. Have it removed if it is stale, or "
            f"choose a directory of your own")


def way_fault(path: str, st: os.stat_result) -> str | None:
    """Why directory ``path`` (status ``st``), with the root somewhere below it, lets another
    user rename what is below it, or None."""
    if _everyone_writes(st) and not st.st_mode & stat.S_ISVTX:
        return (f"{path} can be written by every user and has no sticky bit, so any of "
                f"them can rename what tierstore keeps below it and put something else "
                f"there; choose a path below a directory only you can write, or run "
                f"chmod +t {path} (or chmod o-w {path})")
    return None


def below_root_fault(path: str, st: os.stat_result, root: str) -> str | None:
    """Why directory ``path`` (status ``st``) below the tier's root ``root`` is not this
    user's to use, or None."""
    me = os.geteuid()
    if st.st_uid in (me, 0):
        return None
    return (f"{path} belongs to {_user(st.st_uid)}, not to this user ({_user(me)}): another "
            f"user made it in the tier's root {root} and can replace the files tierstore "
            f"would keep in it. Have it removed (or given to you: chown), then save again")


def check_open_root(fd: int, root: str) -> None:
    """Raise :class:`UnsafeDirectoryError`, naming ``root``, its owner and what to do, when the
    directory open as ``fd`` (the tier's root) is not this user's alone to change."""
    fault = root_fault(os.fstat(fd), root)
    if fault is not None:
        raise UnsafeDirectoryError(f"the tier root {root}", fault)


def root_fault(st: os.stat_result, root: str) -> str | None:
    """Why the root with status ``st`` is not this user's alone to change, or None."""
    me = os.geteuid()
    if st.st_uid != me:
        return (f"{root} belongs to {_user(st.st_uid)}, not to this user ({_user(me)}), "
                f"and whoever owns a tier's root can replace the checkpoints in it; use a "
                f"directory of your own (tierstore makes a missing one), or have its owner "
                f"remove it or give it to you (chown)")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"{root} (mode {stat.S_IMODE(st.st_mode):04o}) can be written by every user, "
                f"any of whom could then replace the checkpoints in it; run chmod o-w {root}")
    return None


def _everyone_writes(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH)


def _user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
