"""Who may change a tier's directory: only the user the job runs as.

Whoever can write a tier's root can swap what a save writes or a load reads (a directory
renamed away and another put in its place, names planted before the job makes them). The
default roots are in ``/dev/shm``, where every local user may create directories, so another
user could make ``/dev/shm/tierstore-peer`` before the job does. A local tier's root is
therefore refused at open (``Backend.check_reachable``, a ConfigError naming the tier) when:

- the root is not owned by this user (by uid; root's own uid 0 is no exception), or every user
  can write it without the sticky bit (``chmod o-w`` fixes it; with the sticky bit, as on
  ``/dev/shm`` itself, others can add names but never rename or remove ours);
- a directory on the way to it can be written by every user without the sticky bit (anyone
  could rename what is below and put something else there);
- a directory or symbolic link on the way sits in a directory every user can write (``/tmp``,
  ``/dev/shm``) and belongs to neither this user nor root: another user made it.

Directories only a group can write are trusted, on the way and as the root (project directories
on shared filesystems are made so, and under user private groups, the common umask 002 makes
every new directory group-writable: the group is the user), and the root's own checks are repeated, on its descriptor,
each time the root is opened (:func:`check_open_root`), so a root swapped after the open is
refused too. Directories tierstore makes itself are owner-writable only (``DIR_MODE``).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

__all__ = ["DIR_MODE", "check_open_root", "root_problem"]

#: mode of the directories tierstore makes (the tier root, the places it is made in, the
#: checkpoints' directories): written by the owner only, read as the umask allows
DIR_MODE = 0o755

# Symbolic links followed on the way to a root before giving up (the kernel's own limit).
_MAX_LINKS = 40


def root_problem(root: str) -> str | None:
    """Why ``root`` (an absolute path, which may go through symbolic links and need not exist
    yet) could be changed by another user, as a sentence naming the path, its owner and what
    to do; None when only this user can change it. Writes nothing."""
    me = os.geteuid()
    todo = [part for part in reversed(root.split("/")) if part]  # next component last
    here, here_st = "/", os.stat("/")
    links = 0
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            here = os.path.dirname(here)
            here_st = os.stat(here)
            continue
        path = os.path.join(here, part)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None  # the rest is made by tierstore itself, owner-writable only
        except OSError:
            return None  # unreadable: check_reachable says why the tier cannot be used
        if _everyone_writes(here_st) and st.st_uid not in (me, 0):
            return (f"{path} belongs to {_user(st.st_uid)}, not to this user "
                    f"({_user(me)}), and it is in {here}, where every user can create "
                    f"entries: another user made it and can replace what tierstore keeps "
                    f"below it. Have it removed if it is stale, or choose a directory "
                    f"of your own")
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return None  # the open fails on its own (ELOOP), with its own message
            target = os.readlink(path)
            if target.startswith("/"):
                here, here_st = "/", os.stat("/")
            todo.extend(p for p in reversed(target.split("/")) if p)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return None  # not a directory: check_reachable says so
        if todo and _everyone_writes(st) and not st.st_mode & stat.S_ISVTX:  # the root: below
            return (f"{path} can be written by every user and has no sticky bit, so any of "
                    f"them can rename what tierstore keeps below it and put something else "
                    f"there; choose a path below a directory only you can write, or run "
                    f"chmod +t {path} (or chmod o-w {path})")
        here, here_st = path, st
    return _root_fault(here_st, root)


def check_open_root(fd: int, root: str) -> None:
    """Raise PermissionError, naming ``root``, its owner and what to do, when the directory
    open as ``fd`` (the tier's root) is not this user's alone to change."""
    fault = _root_fault(os.fstat(fd), root)
    if fault is not None:
        raise PermissionError(errno.EACCES, f"refusing the tier root {root}: {fault}")


def _root_fault(st: os.stat_result, root: str) -> str | None:
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
