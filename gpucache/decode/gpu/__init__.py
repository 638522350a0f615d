"""The GPU backends (nvjpeg, dali, the device tier's pixels) and the helpers they have in common."""
