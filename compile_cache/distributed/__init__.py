"""Ranks and nodes share one compile: one process compiles, every other rank restores.

Used by :func:`compile_cache.compile_regions` when ``torch.distributed`` is initialized (and by
:func:`warm_up`, which a job may call itself). Nothing here ever blocks inside a forward: forwards
of DDP/FSDP models run collectives, and a rank waiting there for another rank's compile would
deadlock the job. All coordination happens in :func:`warm_up`, before the first training or
inference step, with example inputs the job provides.

How ranks stay in step (issue #14): every rank's warm-up joins a *round* in the job's c10d store
(no collective): the round is complete when every rank has arrived, or abandoned, for every rank
at once, when one of them waited ``COMPILE_CACHE_WAIT_TIMEOUT`` (a rank that calls
``compile_regions`` once more than the others warms up alone after that wait; the ranks' next
calls meet again). All keys, barriers and decisions of a warm-up are named after its round and
the round's nonce. A decision several ranks act on (send a key's packs or not; the round itself)
is one ``compare_set`` in the store: the first proposal wins and every rank acts on what it reads
back, so no rank ever enters a collective another rank skipped. Every wait is bounded and says
what it waits for. A rank whose warm-up raises (its forward failed) still signals the ranks that
wait for it, marks itself gone and arrives at the barrier, then the error reaches its caller.
Without a c10d store the warm-up raises :class:`~compile_cache.errors.DistributedSetupError`
(``dist.barrier()`` instead would pair with the job's own collectives).

Modes (``compile_regions(..., distributed=...)``, ``warm_up(..., mode=...)``, or the environment
variable ``COMPILE_CACHE_DISTRIBUTED``; the argument wins; default ``shared``):

``shared``
    ``COMPILE_CACHE_DIR`` is one directory every rank reaches (NFS, Lustre, GPFS...). Every rank
    restores what the store holds when ``compile_regions`` runs. With example inputs, when the
    store has no pack made by a warm-up with the same input signature, the lowest rank of each
    key takes the store's lock for the key, runs the warm-up (compiles) and publishes; the other
    ranks wait outside any forward (polling the job's c10d store, with ``COMPILE_CACHE_WAIT_TIMEOUT``,
    not a collective, so no NCCL watchdog fires), then restore and run their own warm-up forward,
    which hits the FX-graph cache. The leader names the packs it published; a follower that does
    not see them yet (NFS attribute caching) lists the store again with a short backoff, about
    5 s in all, before it compiles itself. Without example inputs nothing blocks: ranks compile lazily
    at their first forward, the first to finish publishes, and the others publish only artifacts
    the key does not hold yet (see "Duplicates" below).

``broadcast``
    No shared filesystem: every rank (or node) has its own store. The rank with the key's packs
    (or, if none has them, the lowest rank with the key, which compiles) sends them with
    ``broadcast_object_list`` over a group of exactly the ranks that send and receive, once they
    all agreed to; each receiver publishes them into its own store (content-addressed: the same
    pack name) and restores them into its local Inductor dir. All sources compile first, side by
    side, then the keys are sent one by one. ``COMPILE_CACHE_BROADCAST_SCOPE=node`` (rank 0's
    value counts) sends to one rank per host, its lowest, which publishes the packs into the
    host's store for every key some rank of its host needs, whether or not it has the key, and
    always tells them (``ok`` or ``skip``); the other ranks of a host restore from the host's
    store, which they must share (a node-local ``COMPILE_CACHE_DIR``). Broadcasting needs example
    inputs; without them each rank compiles and publishes into its own store.

``off``
    No coordination: every rank warms up by itself (the final barrier still applies, on the
    round's name; ``warm_up(..., mode="off", barrier=False)`` needs no c10d store at all).

The store's lock (``store.lock(key)``) keeps two *jobs* sharing a store (or two processes outside
a distributed job) from compiling the same key at once; correctness never depends on it. While
the holder compiles, a heartbeat refreshes the lock every ``COMPILE_CACHE_LOCK_STALE / 10``
seconds, so a waiter keeps waiting past ``COMPILE_CACHE_LOCK_TIMEOUT`` (300 s) while the holder
is alive (up to ``COMPILE_CACHE_WAIT_TIMEOUT``), then restores what it published; a lock whose
heartbeat is older than ``COMPILE_CACHE_LOCK_STALE`` (120 s) is broken, and past the wait the
waiter compiles anyway. A leader that dies is noticed by the waiters' timeout (or by the c10d
store failing); they then compile themselves.

Warm-up compiles what the job will run: under ``torch.no_grad()`` for a model in eval mode, forward
and backward for a model in training mode (or ``train=True``). Training flags, gradients (params
whose grad was None get None again; others get their old values back in place), buffers (BatchNorm
statistics) and the RNG state are restored afterwards. A DDP-wrapped model is warmed through its
``.module`` (no all-reduce while one rank runs alone). A model with FSDP2 (``fully_shard``) modules
cannot run on one rank alone (its forward all-gathers), so all ranks warm up together: call
``compile_regions(model, example_inputs=...)`` *before* ``fully_shard`` for a single compile.

After the warm-up a barrier (``barrier=True``, default) holds every rank until all are ready, so a
warm rank does not race ahead of cold ones into collectives that time out (pytorch #108971).

Duplicates: two ranks that compile the same graph can produce byte-different files (two g++
runs, pickles with timestamps), so content addressing alone would store both. Torch names FX
entries and kernels by its own content keys, so a rank publishes only member *names* the key's
packs do not hold yet (``CacheSession.known_members``).

Hazards (``doctor`` material): on entry the ranks exchange their CPU thread count, device index
and environment key; ranks that differ would silently miss each other's compiled code, and a
warning (once per process) names the fix: ``torchrun --virtual-local-rank`` or one GPU per rank
via ``CUDA_VISIBLE_DEVICES`` (so every rank runs on ``cuda:0``), and ``torch.set_num_threads(N)`` /
``OMP_NUM_THREADS=N`` with one fixed N on every rank.

Recipes::

    # shared directory (NFS/Lustre), torchrun on every node
    export COMPILE_CACHE_DIR=/lustre/$USER/compile_cache OMP_NUM_THREADS=8
    torchrun --nnodes 8 --nproc-per-node 8 --virtual-local-rank ... train.py
    # train.py
    compile_cache.compile_regions(model, example_inputs=(batch,))   # before DDP / fully_shard

    # no shared filesystem: ranks broadcast the packs; one receiver per node
    export COMPILE_CACHE_DISTRIBUTED=broadcast COMPILE_CACHE_BROADCAST_SCOPE=node
    export COMPILE_CACHE_DIR=/local/scratch/compile_cache

Modules: :mod:`.warm_up_report` (modes, WarmUpReport), :mod:`.rendezvous` (the c10d store: rounds,
waits, signals, decisions, barriers, groups), :mod:`.hazards` (settings that split keys across
ranks), :mod:`.protocol` (the warm-up itself), :mod:`.steps` (what one rank does: its warm-up
forward, a compile under the lock), :mod:`.shared` and :mod:`.broadcast` (the two modes).
"""

from __future__ import annotations

from .hazards import check_hazards, cross_rank_hazards, note_lazy
from .protocol import warm_up
from .warm_up_report import MODES, WarmUpReport, coordinates, is_active, last_warm_up, resolve_mode

__all__ = [
    "MODES",
    "WarmUpReport",
    "check_hazards",
    "coordinates",
    "cross_rank_hazards",
    "is_active",
    "last_warm_up",
    "note_lazy",
    "resolve_mode",
    "warm_up",
]
