"""The commands as library functions (show, scan, verify, diff, convert, rescale): no format or framework named."""
