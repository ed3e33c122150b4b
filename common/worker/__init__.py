"""The worker shell: the base loop, the session with the dispatcher, backend interfaces and held jobs."""
