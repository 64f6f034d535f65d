"""A model over several ranks: tensor-parallel shards and their collectives, pipeline stages."""
