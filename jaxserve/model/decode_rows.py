"""The columns of a decode call's one host array, `rows` [B, PAGES + pages_per_seq] int32.

Everything a decode step's rows need from the host crosses to the device as this one array:
twelve arrays crossing one by one cost the host about 2 µs each here (and a transfer each on a
GPU), one costs the same as any of them. The input batch (input_batch.py) keeps the per-slot
columns in a table of this width, so one gather gives a call's rows; the runner writes the
per-call columns; model/step.py unpacks them on the device. float32 and uint32 values are held
as their bits. Constants only: the host and the model both import them.
"""

# per call (the table holds HOST_TOKEN 0, SRC -1, START and QUERY_LEN 0: a padding row's)
HOST_TOKEN = 0  # the row's input token, when SRC is -1
SRC = 1  # the carry row holding the row's input token (on the device), -1: HOST_TOKEN
START = 2  # the row's position: the tokens in its pages before this step
QUERY_LEN = 3  # 1 for a row, 0 for padding
# per slot (slot 0 is padding: greedy, no logprobs, the null page)
TEMPERATURE = 4  # float32 bits; 0: greedy
TOP_K = 5  # vocab_size: off
TOP_P = 6  # float32 bits; 1.0: off
SEED = 7  # uint32 bits: input_batch.device_seed of the request's seed
LOGPROBS = 8  # 1: the request asked for logprobs
LORA = 9  # the request's LoRA slot (model/lora.py); 0: the base model
PAGES = 10  # the page table, from here to the end
