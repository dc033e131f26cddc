"""horovodrun's own command line, with its build check answered by the test session.

Before every launch horovodrun checks that Horovod was built with Gloo (or MPI) by importing
horovod.tensorflow, and so TensorFlow, in a forked process: about 6 of the 12 seconds a 2-rank
launch takes on two cores, and the suite launches some fifty jobs. tests/hvdrun.py asks Horovod
once (the same `gloo_built()` / `mpi_built()` calls on the extension) and passes the answer in
HC_HOROVOD_BUILT; everything else is horovodrun's: `horovod.runner.launch.run_commandline`.
The plain `horovodrun` runs in the text-example test and in `make demo`."""
import os
import sys

from horovod.runner import launch

BUILT = set(os.environ["HC_HOROVOD_BUILT"].split(","))
launch.gloo_built = lambda verbose=False: "gloo" in BUILT
launch.mpi_built = lambda verbose=False: "mpi" in BUILT

if __name__ == "__main__":
    sys.exit(launch.run_commandline())
