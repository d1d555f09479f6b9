#!/bin/sh
# The image's one entrypoint, for every role (installed as dipaco-entrypoint by deploy/install.sh):
#
#   IMAGE coordinator serve ...      -> dipaco coordinator serve ...   (arguments of `dipaco`)
#   IMAGE dipaco island join ...     -> dipaco island join ...
#   IMAGE torchrun --nproc-per-node 4 -m dipaco island join ...        (multi-GPU island, docs/ISLAND.md)
#   IMAGE python|sh ...              -> as given (admin steps, debugging)
#
# exec, so the command is PID 1 and receives SIGTERM itself: an island releases its lease and leaves
# (docs/ISLAND.md, Signals); torchrun forwards the signal to its ranks.
set -e
case "${1:-}" in
    dipaco|torchrun|python|python3|sh|bash) exec "$@" ;;
    *) exec dipaco "$@" ;;
esac
