"""The data: the built-in task, reading a local file or a Hub data set, converting its format to chat rows, checking
rows, the split."""
