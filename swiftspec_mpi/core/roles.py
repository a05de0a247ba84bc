"""The two rank groups of a run, by number: the MPI split color of core.topology and the `role`
column of the trace (trace.record, trace.read.ROLE_NAMES)."""

ROLE_VERIFY, ROLE_DRAFT = 0, 1
