"""`python -m swiftspec_mpi ...` is the same as the `swiftspec` console script."""
import sys

from swiftspec_mpi.cli.main import main

sys.exit(main())
