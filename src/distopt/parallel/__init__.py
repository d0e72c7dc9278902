"""The process groups a model trains over: data-parallel groups (flat or hierarchical),
tensor-parallel meshes of DTensor params, and the DTensor helpers the buffers use."""
