"""The NDJSON front end on the Unix socket (docs/protocol.md): its wire types, one typed
Decoder and Encoder, connections with their reply order, and the ops."""
