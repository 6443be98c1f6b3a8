"""CronFlows: the pure plan of one CronFlow (`plan`) and its controller (`controller`)."""
