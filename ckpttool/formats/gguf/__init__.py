"""GGUF (llama.cpp's model files), read: the format as the registry drives it is
:data:`ckpttool.formats.gguf.format.FORMAT`; :mod:`.reader` parses the header and
:mod:`.quants` decodes the block-quantized types."""
