"""The global sample order of an epoch: a seeded bijection over [0, n) computed per position, never stored.

Epoch `e` visits dataset index `order[p]` at position `p`, where `order = epoch_order(n, seed=s,
epoch=e)`. The order is a keyed Feistel network over the `m`-bit integers (`2**m` the smallest power of
two >= n, so at most 2n values) with cycle-walking: a position is enciphered, and re-enciphered while the
result is >= n, which restricts the bijection of [0, 2**m) to a bijection of [0, n). So any rank computes
the sample at any position in O(1) memory (a few 64-bit words of key) and O(1) expected time (fewer than
2 walks on average), for any n, without materializing a permutation of n entries.

The network has 8 rounds with alternating half widths (`m // 2` and `m - m // 2` bits, so every m works);
each round function is the splitmix64 finalizer of the right half xor a 64-bit round key. The round keys
come from `numpy.random.SeedSequence([seed, epoch])`, whose output numpy keeps stable across versions.
Measured quality (n = 10**6, 10 seeds, see tests/test_order.py): Pearson correlation of position and index
|r| < 0.003, lag-1 autocorrelation of the sequence |r| < 0.003, fixed points 0-2 per epoch (a uniform
random permutation has 1 on average), and a chi-square test of the 32 x 32 (position, index) histogram
within the range of a uniform permutation.
"""

from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

__all__ = ["EpochOrder", "epoch_order"]

_ROUNDS = 8  # even, so the half widths end where they started
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class EpochOrder:
    """The order in which one epoch visits dataset indices: position -> index, a bijection of [0, n).

    Build it with `epoch_order`. `order[p]` is the index at position `p`, `order[a:b]` the indices of a
    range of positions, and `order.indices(positions)` those of any int array of positions (vectorized,
    O(len(positions)) memory). Nothing of size n is ever allocated.
    """

    num_samples: int
    seed: int
    epoch: int
    shuffle: bool = True
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _bits: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.seed < 0 or self.epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={self.seed}, epoch={self.epoch}")
        if self.num_samples > 2**62:
            raise ValueError(f"num_samples={self.num_samples} exceeds 2**62")
        keys = np.random.SeedSequence([self.seed, self.epoch]).generate_state(_ROUNDS, dtype=np.uint64)
        width = max(2, (self.num_samples - 1).bit_length())
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_bits", (width // 2, width - width // 2))

    def __len__(self) -> int:
        return self.num_samples

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> np.ndarray: ...

    def __getitem__(self, key: int | slice) -> int | np.ndarray:
        """The index at one position, or the int64 indices of a slice of positions."""
        if isinstance(key, slice):
            return self.indices(np.arange(*key.indices(self.num_samples), dtype=np.int64))
        position = int(key)
        if position < 0:
            position += self.num_samples
        if not 0 <= position < self.num_samples:
            raise IndexError(f"position {key} is outside an order of {self.num_samples} samples")
        return int(self.indices(np.array([position], dtype=np.int64))[0])

    def indices(self, positions: npt.ArrayLike) -> np.ndarray:
        """Dataset indices (int64, same shape) at the given positions, each in [0, num_samples)."""
        pos = np.asarray(positions)
        if pos.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got dtype {pos.dtype}")
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_samples):
            raise IndexError(
                f"positions [{int(pos.min())}, {int(pos.max())}] are outside an order of "
                f"{self.num_samples} samples"
            )
        if not self.shuffle or self.num_samples == 1:
            return pos.astype(np.int64)
        out = self._encipher(pos.astype(np.uint64).ravel())
        # Cycle-walking: re-encipher the values that fell into [n, 2**m) until they land in [0, n).
        bound = np.uint64(self.num_samples)
        todo = np.flatnonzero(out >= bound)
        while todo.size:
            walked = self._encipher(out[todo])
            out[todo] = walked
            todo = todo[walked >= bound]
        return out.astype(np.int64).reshape(pos.shape)

    def _encipher(self, x: np.ndarray) -> np.ndarray:
        """The Feistel permutation of [0, 2**m) on a uint64 array (a new array)."""
        left_bits, right_bits = self._bits
        left = x >> np.uint64(right_bits)
        right = x & np.uint64((1 << right_bits) - 1)
        for key in self._keys:
            # (L: left_bits, R: right_bits) -> (R, L ^ F(R)): the widths swap every round.
            f = right ^ key
            f ^= f >> np.uint64(30)
            f *= _MIX1
            f ^= f >> np.uint64(27)
            f *= _MIX2
            f ^= f >> np.uint64(31)
            left, right = right, left ^ (f >> np.uint64(64 - left_bits))
            left_bits, right_bits = right_bits, left_bits
        return (left << np.uint64(right_bits)) | right


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
    """The order in which epoch `epoch` visits dataset indices: seeded by (seed, epoch), or 0..n-1.

    It depends only on these four values, never on the mesh, and costs O(1) memory for any n.
    """
    return EpochOrder(num_samples, seed, epoch, shuffle)
