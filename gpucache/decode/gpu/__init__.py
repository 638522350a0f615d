"""The GPU backends (nvjpeg, dali, the device tier's pixels) and what they share."""
