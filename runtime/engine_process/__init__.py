"""Engine processes: the engine's step loop in a process of its own, behind the server's front — one
(`serve --engine-process on`) or N data-parallel replicas (`--data-parallel-size N`), one mechanism.

`data_parallel.py` is the front's engine over them (AsyncEngine's interface), `router.py` picks a replica for a
request, `client.py` is the front's side of one process (its socket, its requests' states), `replica.py` the
process itself (`python -m runtime.engine_process.replica`), `messages.py` the wire between them: one msgspec
`Step` a step.
"""
