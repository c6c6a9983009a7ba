"""One module per `kvhandoff` subcommand, each exposing `configure(parser)` and
`execute(args) -> int`. The CLI imports only the chosen one, so the offline log commands never
import nats."""
