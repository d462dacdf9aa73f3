from smetric.cli import app

app(prog_name="smetric")
