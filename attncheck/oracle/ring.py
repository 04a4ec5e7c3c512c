"""Token bookkeeping for ring attention over a contiguously sharded sequence.

A sequence of num_devices * seq_per_device tokens is split into contiguous chunks:
device d holds q, k and v for global tokens [d * seq_per_device, (d + 1) * seq_per_device).
Rotation assumed: kv chunks travel from device d to device d + 1 (mod n) each step,
so at ring step s device d holds the kv chunk that started on device (d - s) mod n;
step 0 is the device's own chunk. The truth for a ring kernel is dense.attention
over the whole sequence; these helpers only say which global positions each
device-step block covers, e.g. to build per-block oracle calls.
"""

import numbers

import numpy as np

from attncheck.oracle import dense


def _in_range(name, x, upper):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < upper:
        dense._fail(name, f"an integer in [0, {upper})", repr(x))


def global_positions(num_devices, seq_per_device):
    """(q_positions, kv_positions), each int64 [num_devices, seq_per_device]: row d holds
    the global positions of the tokens device d owns (equal for q and kv under contiguous sharding)."""
    dense._positive_int("num_devices", num_devices)
    dense._positive_int("seq_per_device", seq_per_device)
    positions = np.arange(num_devices * seq_per_device, dtype=np.int64).reshape(num_devices, seq_per_device)
    return positions, positions.copy()


def ring_step_offsets(num_devices, device, step, *, seq_per_device):
    """(q_offset, kv_offset) in tokens: the first global position of device's q chunk
    and of the kv chunk it holds at ring step `step`, that of device (device - step) mod n."""
    dense._positive_int("num_devices", num_devices)
    _in_range("device", device, num_devices)
    _in_range("step", step, num_devices)
    dense._positive_int("seq_per_device", seq_per_device)
    return device * seq_per_device, (device - step) % num_devices * seq_per_device
