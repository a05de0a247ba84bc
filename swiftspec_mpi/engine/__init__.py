"""The decode loops: single group (ar, sync) and disaggregated (async), their sides, protocol."""
