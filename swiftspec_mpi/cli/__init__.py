"""The `swiftspec` command line and the job lifecycle of `swiftspec run`."""
