"""The one L2 rule of the Triton cost models (docs/performance.md,
"How traffic is counted").

Reuse distance (``reuse_traffic``): programs start in launch order as slots free up; a re-read
hits when the previous program that loaded the tile started few enough programs earlier for
the bytes streamed in between to fit in the usable L2, whatever the waves. ``Programs`` records
a launch's loads and stores from its grid and counts them by that rule.
"""

from __future__ import annotations

import functools
import math

import torch

from fusedops.core.target import target_arch


def key(*parts) -> torch.Tensor:
    """One int64 key per entry from (values, bound) pairs, in mixed radix."""
    key = None
    for values, bound in parts:
        key = values if key is None else key * bound + values
    return key


class Programs:
    """A launch's working programs in launch order (the grid ``dims``, the first dimension
    fastest; programs ``active`` rejects return at once and take no slot) and what each loads
    and stores. ``load`` records the tiles (keyed by what they hold, per operand) programs load;
    ``alone`` what a program loads that no other does; ``store`` what it writes. ``count``: the
    bytes read and written by reuse distance (``reuse_traffic``) in the L2 of ``l2_bytes``."""

    def __init__(self, dims, l2_bytes: float, active=None):
        idx = torch.arange(math.prod(dims), dtype=torch.int64)
        coords = []
        for extent in dims:
            coords.append(idx % extent)
            idx = idx // extent
        if active is not None:
            keep = active(*coords)
            coords = [c[keep] for c in coords]
        self.coords = coords
        self.programs = int(coords[0].numel())
        self.l2_bytes = l2_bytes
        self._loads: dict = {}
        self._alone, self._stores = [], []

    def loop(self, m: int, keep=None):
        """(program, k) for every program and k in range(m) where keep(program, k)."""
        prog = torch.arange(self.programs).repeat_interleave(m)
        k = torch.arange(m).repeat(self.programs)
        if keep is not None:
            mask = keep(prog, k)
            prog, k = prog[mask], k[mask]
        return prog, k

    def ranges(self, first, count):
        """(program, index) for every program p and index in first[p] .. first[p] + count[p] - 1
        (the blocks of a loop whose bounds differ between programs)."""
        count = torch.as_tensor(count, dtype=torch.int64).expand(self.programs)
        first = torch.as_tensor(first, dtype=torch.int64).expand(self.programs)
        prog = torch.repeat_interleave(torch.arange(self.programs), count)
        start = torch.cumsum(count, 0) - count
        return prog, first[prog] + torch.arange(len(prog)) - start[prog]

    @staticmethod
    def _bytes(prog, nbytes) -> torch.Tensor:
        return torch.as_tensor(nbytes, dtype=torch.float64).expand(prog.shape)

    def load(self, operand: str, prog, key, nbytes) -> None:
        nbytes = self._bytes(prog, nbytes)
        keep = nbytes > 0                                     # masked off: nothing moves
        self._loads.setdefault(operand, []).append((prog[keep], key[keep], nbytes[keep]))

    def alone(self, prog, nbytes) -> None:
        self._alone.append((prog, self._bytes(prog, nbytes)))

    def store(self, prog, nbytes) -> None:
        self._stores.append((prog, self._bytes(prog, nbytes)))

    def _per_program(self, pairs) -> torch.Tensor:
        out = torch.zeros(self.programs, dtype=torch.float64)
        for prog, nbytes in pairs:
            out += torch.bincount(prog, weights=nbytes, minlength=self.programs)
        return out

    def count(self) -> tuple[float, float]:
        """(bytes read, bytes written)."""
        loads = [tuple(torch.cat([part[i] for part in parts]) for i in range(3))
                 for parts in self._loads.values()]
        return reuse_traffic(self.programs, loads, self._per_program(self._alone),
                             self._per_program(self._stores), self.l2_bytes)


def per_arch(fn):
    """``fn`` cached per (problem, tiles, arguments) and the target architecture whose L2 the
    traffic is counted in; ``cache_clear()`` empties the cache (a test that changes
    ``fusedops.core.machines.MACHINES`` calls it)."""
    cached = functools.lru_cache(maxsize=128)(lambda arch, *args: fn(*args))

    @functools.wraps(fn)
    def wrapper(*args):
        return cached(target_arch(args[0].device), *args)
    wrapper.cache_clear = cached.cache_clear
    return wrapper


def every_program(w: Programs) -> torch.Tensor:
    """Every program of ``w``, in launch order."""
    return torch.arange(w.programs)


# -- reuse distance ---------------------------------------------------------------------------------
L2_SHARE = 0.5
"""The part of a machine's L2 a re-read may count on. Hopper splits its L2 in two partitions, each
caching for the SMs of the GPCs wired to it (a line both halves read is held twice), Blackwell's
two dies each have their own half, and replacement is not an exact LRU: half the capacity."""


def reuse_traffic(programs: int, loads, alone: torch.Tensor, stores: torch.Tensor,
                  l2_bytes: float) -> tuple[float, float]:
    """(bytes read, bytes written) of a launch of ``programs`` working programs, counted by reuse
    distance (docs/performance.md, "How traffic is counted").

    Programs start in launch order as slots free up, so between the starts of programs q < p the
    machine streams about p - q programs' worth of bytes through the L2 (every resident program
    advances by (p - q) / W of its work). A program's load of a tile therefore hits when the
    previous program that loaded the same tile is at most G programs earlier, G = the usable L2
    (``L2_SHARE`` of ``l2_bytes``) over the mean bytes a program loads and stores, and misses
    otherwise; a tile's first load always counts. A program loading a tile twice counts it once.

    ``loads``: per operand, (program [n] in 0..programs-1, tile key [n] >= 0 within the
    operand, bytes [n]); ``alone`` and ``stores``: per program, the bytes it loads that no other
    program does and the bytes it writes ([programs], all counted)."""
    if not programs:
        return 0.0, 0.0
    parts = [(p.to(torch.int64), k.to(torch.int64) * len(loads) + i,
              torch.as_tensor(b, dtype=torch.float64).expand(p.shape))
             for i, (p, k, b) in enumerate(loads)]
    prog = torch.cat([p for p, _, _ in parts]) if parts else torch.zeros(0, dtype=torch.int64)
    keys = torch.cat([k for _, k, _ in parts]) if parts else torch.zeros(0, dtype=torch.int64)
    nbytes = torch.cat([b for _, _, b in parts]) if parts else torch.zeros(0, dtype=torch.float64)
    streamed = float(nbytes.sum() + alone.sum() + stores.sum())
    gap = L2_SHARE * l2_bytes / max(streamed / programs, 1.0)
    pair, inverse = torch.unique(keys * programs + prog, return_inverse=True)   # sorted
    tile_bytes = torch.zeros(len(pair), dtype=torch.float64).scatter_reduce_(
        0, inverse, nbytes, "amax", include_self=False)
    key, at = pair // programs, pair % programs
    hit = torch.zeros(len(pair), dtype=torch.bool)
    hit[1:] = (key[1:] == key[:-1]) & (at[1:] - at[:-1] <= gap)
    return float(tile_bytes[~hit].sum() + alone.sum()), float(stores.sum())
