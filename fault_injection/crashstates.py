"""The crash states Linux permits after a recording, enumerated, sampled and materialised.

Model (ALICE, LazyFS, LevelDB's fault-injection env; docs/reliability.md):

- a crash point ``k`` means ops ``0..k-1`` were issued and op ``k`` never was;
- a file's data ops before its last completed ``Sync`` are durable; of the
  ones after it, any *prefix* may survive, and the last surviving write may be
  *torn* at a 512-byte boundary (only its first sectors reached the disk);
- a directory's namespace ops (create, mkdir, rename, unlink) before its last
  completed ``SyncDir`` are durable; of the ones after it, any prefix may
  survive (the journal keeps their order), independently for each directory.
  A rename is counted in the directory it renames *into*;
- a file that no surviving name reaches is gone;
- *page-order states*: the page cache writes dirty pages back in any order,
  so of a file's unsynced writes any subset of the 4 KiB pages they touched
  may reach the disk (each with its latest content), with the file's size
  either its durable size or its size after every issued op; a page that did
  not reach the disk keeps its durable bytes, or zeros past the durable size.

A ``Recipe`` names one state: the crash point, and for each file and
directory with unsynced ops how many of them survive (and the torn length),
or for a file which of its dirty pages survive. Its text form is what
``python -m fault_injection powercut --replay`` (and ``relaycrash --replay``) accepts.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from collections.abc import Iterator

import attrs

from fault_injection.recording import (
    ROOT_INO,
    Event,
    Link,
    NamespaceOp,
    Recording,
    Rename,
    Sync,
    SyncDir,
    Truncate,
    Unlink,
    Write,
)

SECTOR = 512
PAGE = 4096
TORN_VARIANTS = 2


@attrs.frozen
class Recipe:
    """One crash state: ``files`` ino -> (surviving unsynced data ops, torn length or -1); ``dirs`` ino -> count;
    ``pages`` ino -> (bitmask over ``Walker.dirty_pages(ino)`` of the pages that reached the disk, 1 if the size
    after every issued op survived, 0 if the durable size did)."""

    point: int
    files: tuple[tuple[int, int, int], ...]
    dirs: tuple[tuple[int, int], ...]
    pages: tuple[tuple[int, int, int], ...] = ()

    def text(self) -> str:
        parts = [f"K={self.point}"]
        parts += [f"F{ino}={n}" + (f"/{torn}" if torn >= 0 else "") for ino, n, torn in self.files]
        parts += [f"D{ino}={n}" for ino, n in self.dirs]
        parts += [f"P{ino}={mask:x}/{full}" for ino, mask, full in self.pages]
        return ";".join(parts)

    @classmethod
    def parse(cls, text: str) -> Recipe:
        point = -1
        files: list[tuple[int, int, int]] = []
        dirs: list[tuple[int, int]] = []
        pages: list[tuple[int, int, int]] = []
        for part in filter(None, text.strip().split(";")):
            key, _, value = part.partition("=")
            if key == "K":
                point = int(value)
            elif key.startswith("F"):
                n, _, torn = value.partition("/")
                files.append((int(key[1:]), int(n), int(torn) if torn else -1))
            elif key.startswith("D"):
                dirs.append((int(key[1:]), int(value)))
            elif key.startswith("P"):
                mask, _, full = value.partition("/")
                pages.append((int(key[1:]), int(mask, 16), int(full)))
            else:
                raise ValueError(f"bad recipe part {part!r}")
        if point < 0:
            raise ValueError(f"recipe without a crash point: {text!r}")
        return cls(point, tuple(files), tuple(dirs), tuple(pages))


@attrs.define
class State:
    """A materialisable file tree: directories and files by relative path."""

    dirs: list[str]
    files: dict[str, bytes]

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for d in sorted(self.dirs):
            h.update(b"D" + d.encode() + b"\0")
        for path in sorted(self.files):
            h.update(b"F" + path.encode() + b"\0" + hashlib.blake2b(self.files[path], digest_size=16).digest())
        return h.hexdigest()

    def write_to(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        for d in sorted(self.dirs, key=lambda p: p.count("/")):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        for path, data in self.files.items():
            with open(os.path.join(root, path), "wb") as fh:
                fh.write(data)


def _ns_dir(op: NamespaceOp) -> int:
    return op.dst_parent if isinstance(op, Rename) else op.parent


def _apply_ns(entries: dict[int, dict[str, int]], op: NamespaceOp) -> None:
    if isinstance(op, Link):
        entries.setdefault(op.parent, {})[op.name] = op.ino
        if op.is_dir:
            entries.setdefault(op.ino, {})
    elif isinstance(op, Rename):
        src = entries.setdefault(op.src_parent, {})
        if src.get(op.src_name) == op.ino:
            del src[op.src_name]
        entries.setdefault(op.dst_parent, {})[op.dst_name] = op.ino
    else:
        d = entries.setdefault(op.parent, {})
        if d.get(op.name) == op.ino:
            del d[op.name]


def _apply_data(buf: bytearray, op: Write | Truncate, keep: int = -1) -> None:
    if isinstance(op, Truncate):
        del buf[op.length:]
        if len(buf) < op.length:
            buf.extend(bytes(op.length - len(buf)))
        return
    data = op.data if keep < 0 else op.data[:keep]
    end = op.offset + len(data)
    if len(buf) < op.offset:
        buf.extend(bytes(op.offset - len(buf)))
    buf[op.offset:end] = data


def torn_lengths(op: Write) -> list[int]:
    """Lengths at which a write may be cut: sector boundaries strictly inside it (a few of them)."""
    first = (op.offset // SECTOR + 1) * SECTOR
    cuts = [b - op.offset for b in range(first, op.offset + len(op.data), SECTOR)]
    if len(cuts) <= TORN_VARIANTS:
        return cuts
    return [cuts[0], cuts[-1]]


class Walker:
    """Walks a recording once, keeping the durable state and what is pending at each crash point."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.entries: dict[int, dict[str, int]] = {k: dict(v) for k, v in rec.initial_entries.items()}
        self.data: dict[int, bytearray] = {k: bytearray(v) for k, v in rec.initial_data.items()}
        self.pending_data: dict[int, list[Write | Truncate]] = {}
        self.pending_ns: dict[int, list[NamespaceOp]] = {}
        self.pending_ns_index: dict[int, list[int]] = {}
        self.events = 0
        self.point = 0  # the crash point ``points`` stands at

    def points(self) -> Iterator[int]:
        """Yield every crash point that a file operation follows (and the end), after updating the state."""
        ops = self.rec.ops
        for k, op in enumerate(ops):
            if not isinstance(op, Event):
                self.point = k
                yield k
            self._apply(k, op)
        self.point = len(ops)
        yield len(ops)

    def _apply(self, k: int, op: object) -> None:
        if isinstance(op, Event):
            self.events += 1
        elif isinstance(op, Write | Truncate):
            self.pending_data.setdefault(op.ino, []).append(op)
        elif isinstance(op, Sync):
            buf = self.data.setdefault(op.ino, bytearray())
            for data_op in self.pending_data.pop(op.ino, []):
                _apply_data(buf, data_op)
        elif isinstance(op, Link | Rename | Unlink):
            d = _ns_dir(op)
            self.pending_ns.setdefault(d, []).append(op)
            self.pending_ns_index.setdefault(d, []).append(k)
        elif isinstance(op, SyncDir):
            for ns in self.pending_ns.pop(op.ino, []):
                _apply_ns(self.entries, ns)
                if isinstance(ns, Rename):
                    self._settle_source(ns)
            self.pending_ns_index.pop(op.ino, None)

    def _settle_source(self, rename: Rename) -> None:
        """A durable rename also settles the unsynced create of its source name (Maildir's ``tmp/`` file).

        The inode has one name: once it is durable under the new one, the old
        name cannot come back in a later crash state (a journal commits the
        create with the rename that moved it).
        """
        ops = self.pending_ns.get(rename.src_parent, [])
        keep = [i for i, ns in enumerate(ops) if not (isinstance(ns, Link) and ns.ino == rename.ino)]
        if len(keep) < len(ops):
            index = self.pending_ns_index[rename.src_parent]
            self.pending_ns[rename.src_parent] = [ops[i] for i in keep]
            self.pending_ns_index[rename.src_parent] = [index[i] for i in keep]
            if not keep:
                del self.pending_ns[rename.src_parent], self.pending_ns_index[rename.src_parent]

    def choices(self) -> tuple[list[list[tuple[int, int, int]]], list[list[tuple[int, int]]]]:
        """Per dirty file and per dirty directory, the options at the current crash point."""
        files = []
        for ino, ops in sorted(self.pending_data.items()):
            opts = [(ino, n, -1) for n in range(len(ops) + 1)]
            for n, op in enumerate(ops, 1):
                if isinstance(op, Write):
                    opts += [(ino, n, t) for t in torn_lengths(op)]
            files.append(opts)
        dirs = [[(ino, n) for n in range(len(ops) + 1)] for ino, ops in sorted(self.pending_ns.items())]
        return files, dirs

    def dirty_pages(self, ino: int) -> list[int]:
        """The 4 KiB pages that the unsynced writes of ``ino`` touched, in file order."""
        pages: set[int] = set()
        for op in self.pending_data.get(ino, []):
            if isinstance(op, Write) and op.data:
                pages.update(range(op.offset // PAGE, (op.offset + len(op.data) - 1) // PAGE + 1))
        return sorted(pages)

    def paged(self, ino: int, mask: int, full: int) -> bytes:
        """The file ``ino`` after the dirty pages in ``mask`` (bit i: ``dirty_pages(ino)[i]``) reached the disk."""
        durable = bytes(self.data.get(ino, b""))
        final = bytearray(durable)
        for op in self.pending_data.get(ino, []):
            _apply_data(final, op)
        length = len(final) if full else len(durable)
        out = bytearray(durable[:length].ljust(length, b"\0"))
        for i, page in enumerate(self.dirty_pages(ino)):
            if mask >> i & 1:
                lo, hi = page * PAGE, min((page + 1) * PAGE, length)
                if lo < hi:
                    out[lo:hi] = final[lo:hi].ljust(hi - lo, b"\0")
        return bytes(out)

    def state(self, recipe: Recipe) -> State:
        """The file tree of ``recipe`` (whose crash point must be the walker's current one)."""
        entries = self.entries
        kept_ns: list[tuple[int, NamespaceOp]] = []
        for ino, n in recipe.dirs:
            kept_ns += list(zip(self.pending_ns_index[ino][:n], self.pending_ns[ino][:n]))
        if kept_ns:
            entries = {k: dict(v) for k, v in entries.items()}
            for _, ns_op in sorted(kept_ns, key=lambda x: x[0]):
                _apply_ns(entries, ns_op)
        changed: dict[int, bytes] = {}
        for ino, n, torn in recipe.files:
            if n == 0:
                continue
            buf = bytearray(self.data.get(ino, b""))
            ops = self.pending_data[ino][:n]
            for i, op in enumerate(ops):
                _apply_data(buf, op, torn if i == n - 1 else -1)
            changed[ino] = bytes(buf)
        for ino, mask, full in recipe.pages:
            changed[ino] = self.paged(ino, mask, full)
        dirs: list[str] = []
        files: dict[str, bytes] = {}
        stack: list[tuple[int, str]] = [(ROOT_INO, "")]
        while stack:
            dino, prefix = stack.pop()
            for name, ino in entries.get(dino, {}).items():
                path = f"{prefix}{name}"
                if ino in self.rec.dir_inos:
                    dirs.append(path)
                    stack.append((ino, path + "/"))
                else:
                    files[path] = changed[ino] if ino in changed else bytes(self.data.get(ino, b""))
        return State(dirs, files)


def _combos(files: list[list[tuple[int, int, int]]], dirs: list[list[tuple[int, int]]], cap: int,
            rng: random.Random) -> list[tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]]:
    groups: list[list[object]] = [list[object](g) for g in files] + [list[object](g) for g in dirs]
    total = 1
    for g in groups:
        total *= len(g)
    nf = len(files)

    def split(combo: tuple[object, ...]) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]:
        return tuple(combo[:nf]), tuple(combo[nf:])  # type: ignore[arg-type]

    if total <= cap:
        return [split(c) for c in itertools.product(*groups)]
    # Always "only what was synced"; the caller adds "everything issued" (the kill -9 state).
    out = [split(tuple(g[0] for g in groups))]
    seen = {repr(o) for o in out}
    for _ in range(cap * 4):
        if len(out) >= cap:
            break
        c = split(tuple(rng.choice(g) for g in groups))
        if repr(c) not in seen:
            seen.add(repr(c))
            out.append(c)
    return out


def _max_count(groups: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    return [max((o for o in g if o[2] < 0), key=lambda o: o[1]) for g in groups]


@attrs.frozen
class Candidate:
    recipe: Recipe
    events: int
    digest: str


def enumerate_states(rec: Recording, *, per_point: int = 16, seed: int = 0,
                     only_point: int | None = None) -> list[Candidate]:
    """Every distinct (state, acknowledgements) pair, up to ``per_point`` options per crash point."""
    rng = random.Random(seed)
    walker = Walker(rec)
    seen: set[tuple[str, int]] = set()
    out: list[Candidate] = []
    for k in walker.points():
        if only_point is not None and k != only_point:
            continue
        files, dirs = walker.choices()
        combos = _combos(files, dirs, per_point, rng)
        if files:
            # the "everything written survives" state is the kill -9 state: always include it
            full = (tuple(_max_count(files)), tuple(g[-1] for g in dirs))
            if full not in combos:
                combos.append(full)
        for fchoice, dchoice in combos:
            recipe = Recipe(k, tuple(fchoice), tuple(dchoice))
            digest = walker.state(recipe).digest()
            key = (digest, walker.events)
            if key in seen:
                continue
            seen.add(key)
            out.append(Candidate(recipe, walker.events, digest))
    return out


def sample(cands: list[Candidate], max_states: int, seed: int) -> list[Candidate]:
    """At most ``max_states`` candidates, drawn deterministically from ``seed``, in crash-point order."""
    if len(cands) <= max_states:
        return list(cands)
    picked = random.Random(seed).sample(range(len(cands)), max_states)
    return [cands[i] for i in sorted(picked)]


def materialise(rec: Recording, recipes: list[Recipe]) -> Iterator[tuple[Recipe, State, int]]:
    """Yield (recipe, state, number of events before the crash point), in crash-point order."""
    want: dict[int, list[Recipe]] = {}
    for r in recipes:
        want.setdefault(r.point, []).append(r)
    walker = Walker(rec)
    for k in walker.points():
        for r in want.get(k, []):
            yield r, walker.state(r), walker.events


def state_of(rec: Recording, recipe: Recipe) -> tuple[State, int]:
    for r, state, events in materialise(rec, [recipe]):
        if r == recipe:
            return state, events
    raise ValueError(f"crash point {recipe.point} is not in this recording ({len(rec.ops)} ops)")


def event_list(rec: Recording, count: int) -> list[Event]:
    return rec.events()[:count]
