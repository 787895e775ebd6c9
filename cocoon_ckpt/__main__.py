from cocoon_ckpt._cli.main import entry

entry()
