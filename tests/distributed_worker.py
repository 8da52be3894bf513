"""One process of the two-process test in test_sharding.py (run as a script, not collected).

Usage: python distributed_worker.py PORT PROCESS_ID OUT.npz. Each process has 4 CPU devices;
together they form one 8-device mesh. Process 0 writes the gathered results to OUT.npz.
"""

import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

import optclip


def transforms():
    """Shared with the single-process run: name -> (transform, run inside shard_map)."""
    return {
        "clip_by_global_norm": (optclip.clip_by_global_norm(1.0), False),
        "zclip": (optclip.zclip(warmup_steps=2), False),
        "clip_norm_by_ema": (optclip.clip_norm_by_ema(beta=0.5), False),
        "shard_map_clip_by_global_norm": (optclip.clip_by_global_norm(1.0, axis_name="x"), True),
        "shard_map_top_q": (optclip.top_q(0.5, dq=0.2, param_ndim=None, axis_name="x"), True),
    }


def gradients():
    rng = np.random.default_rng(0)
    return [{"w": rng.normal(size=(8, 4)).astype(np.float32) * 3,
             "b": rng.normal(size=(4,)).astype(np.float32)} for _ in range(3)]


SPECS = {"w": PartitionSpec("x"), "b": PartitionSpec()}


def run(mesh, place):
    """Three steps of every transform; returns flat numpy results."""
    results = {}
    for name, (tx, mapped) in transforms().items():
        if mapped:
            def step(g, state, tx=tx):
                out, state = tx.update(g, state)
                return out, state
            init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SPECS,),
                                         out_specs=PartitionSpec()))
            update = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(SPECS, PartitionSpec()),
                                           out_specs=(SPECS, PartitionSpec())))
        else:
            init, update = jax.jit(tx.init), jax.jit(tx.update)
        grads = [place(g) for g in gradients()]
        state = init(grads[0])
        for i, g in enumerate(grads):
            out, state = update(g, state)
            for key, value in optclip.stats(state).items():
                results[f"{name}/{i}/{key}"] = value
            for key, value in out.items():
                results[f"{name}/{i}/out/{key}"] = value
    return results


def main():
    port, process_id, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # Before the backend starts: 4 CPU devices here, cross-process collectives through gloo.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def place(tree):
        return jax.tree.map(lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), lambda index: x[index]), tree, SPECS)

    results = run(mesh, place)
    gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                for k, v in results.items()}
    if process_id == 0:
        np.savez(path, **gathered)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
