"""Settings for the whole test session, loaded before any test module imports torch."""

import os

# Inductor compiles in the process that asks, without a worker pool. The tests fork ranks from the
# pytest process and from forked children; a pool's threads in a forking parent can leave the child
# waiting on a lock no thread of its own will release (CI, cold compile cache: three forked compile
# runs waited out their 400 s). Compiling in-process costs nothing measurable on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
