"""The engine as a library in the caller's process: the driver, its request table, tickets, lifecycle,
switching, the rank processes it launches."""
