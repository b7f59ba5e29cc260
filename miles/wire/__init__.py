"""The wire between the controller and its workers, imported by both sides and by the launcher.

`codec` (msgpack envelope, tensors as out-of-band frames, signed seals), `rpc` (the call
protocol's kinds and errors), `endpoint` and `router_dealer` (the ROUTER/DEALER endpoints), `procs` (spawning, reaping and killing worker processes), `specs` (what to spawn and
how a worker fails), `ports` (free TCP ports) and `launch_env` (where this process sits in a
torchrun or Slurm job). Nothing here imports the controller, the workers or the launcher.
"""
