"""Event records, the HDF5 trace (write, read), and its analysis."""
