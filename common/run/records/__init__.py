"""The run directory's records: the journal's events and its one reader, the epoch schedules, the
sample lengths, job ids and the dispatcher's state file. The dispatcher writes them; the operator's
tools and the benchmarks read them here, never through the daemon's modules."""
