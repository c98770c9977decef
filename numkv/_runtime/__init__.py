"""What numkv's kernels run on: the thread count (``thread_count``), the pool
of worker threads that runs them (``pool``), and the hook that lets
``threadpoolctl`` see and cap that count (``threadpoolctl_hook``)."""
